"""The grouped TurboQuant decode dequantizes 4-bit codes in the MMA's
registers (tq-v0.33/0010).

The stage 1 that the grouped launcher runs for a 4-bit preset is compiled
for sm_90 by Triton's own compiler (no GPU needed) and its TTGIR read: in the
token loop, no floating-point tile of the cache's head-dimension width may
go through shared memory. Before the patch the dequantized fp16 key and
value tiles are the MMA's B operand, stored to shared memory every tile;
with it the tokens are the MMA's M rows, the code bytes go through shared
memory and are dequantized in each thread's A-operand fragment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import tqbatches as tb

SHARED_F16 = r"^the 4-bit decode stores dequantized cache tiles to shared memory"
# 4-bit MSE keys: FP8 keys and 4-bit values already reached the MMA as
# converted bytes before (Triton moved their conversions past the load).
PRESETS = {"4bit_nc": "turboquant_4bit_nc"}
POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
           torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}  # fmt: skip

# Run in a child process: this one runs Triton's interpreter.
COMPILE = """
import json, sys, types
import triton, triton.language as tl
sys.modules["vllm.triton_utils"] = types.SimpleNamespace(tl=tl, triton=triton)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
spec = json.loads(sys.argv[1])
fn = getattr(gd, spec["kernel"])
const = spec["constexprs"]
sig = {a: "constexpr" if a in const else spec["types"][a] for a in fn.arg_names}
src = ASTSource(fn=fn, signature=sig,
                constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
print(k.asm["ttgir"])
"""


@pytest.fixture(scope="module", params=list(PRESETS))
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a tiny GQA model (Hq 8, Hk 2, D 128)."""
    shape = tb.Shape(hq=8, hk=2, head=128, preset=PRESETS[request.param])
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"tiny_{request.param}"
    )


class Launches:
    """Stands in for the grouped decode's kernels: records each launch."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def kernel(self, name: str, fn: Any) -> Any:
        calls = self.calls

        class Recorder:
            arg_names = fn.arg_names

            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> None:
                    calls.append({"kernel": name, "args": args, "kwargs": kwargs})

                return launch

        return Recorder()


def stage1_launch(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The stage-1 launch of the grouped launcher for a decode step."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    launches = Launches()
    # What it launches on CUDA (inline PTX), not in the interpreter.
    monkeypatch.setattr(gd, "_use_ptx", lambda device: True, raising=False)
    for name in dir(gd):
        if name.startswith("_tq_grouped_decode_"):
            monkeypatch.setattr(gd, name, launches.kernel(name, getattr(gd, name)))
    impl, layer, batch = tb.decode_batch(env, [300, 40], seed=3)
    tb.decode_kernels(impl, layer, batch, splits=2, old_splits=None)
    (call,) = [c for c in launches.calls if "stage1" in c["kernel"]]
    return call


def compile_spec(call: dict) -> dict:
    """The launch as the child's JSON: kernel, argument types, constexprs."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    fn = getattr(gd, call["kernel"]).arg_names
    names = [a for a in fn if a not in call["kwargs"]]
    types = {}
    for name, arg in zip(names, call["args"]):
        if isinstance(arg, torch.Tensor):
            types[name] = POINTER[arg.dtype]
        else:
            types[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
    options = {k: v for k, v in call["kwargs"].items() if k not in fn}
    const = {k: v for k, v in call["kwargs"].items() if k in fn}
    return {"kernel": call["kernel"], "types": types, "constexprs": const,
            "options": options}  # fmt: skip


def loop_body(ttgir: str) -> str:
    """The TTGIR between the token loop's scf.for and its scf.yield."""
    start = ttgir.index("scf.for")
    return ttgir[start : ttgir.rindex("scf.yield")]


@pytest.mark.cpu_only  # compiles for sm_90 without a GPU; where one is, the
# child's vLLM picks CudaPlatform, which needs the compiled extensions
@pytest.mark.bug_signature(AssertionError, SHARED_F16)
def test_4bit_codes_dequantized_in_mma_registers(
    env: tb.Backend, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = stage1_launch(env, monkeypatch)
    spec = compile_spec(call)
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child["PYTHONPATH"] = os.pathsep.join([str(vllm_tree), child.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(spec)],
        capture_output=True, text=True, env=child, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    d = spec["constexprs"]["HEAD_DIM"]
    tiles = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+)x(f16|bf16|f32)",
                       loop_body(out.stdout))  # fmt: skip
    wide = [
        f"{s}x{t}" for s, t in tiles if {d, d // 2} & {int(n) for n in s.split("x")}
    ]
    assert not wide, (
        f"the 4-bit decode stores dequantized cache tiles to shared memory every "
        f"step ({', '.join(wide)} in {call['kernel']}), the MMA's B operand, "
        f"instead of dequantizing the code bytes in its registers"
    )
