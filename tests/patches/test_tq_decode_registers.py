"""The grouped TurboQuant decode dequantizes 4-bit codes in the MMA's
registers (tq-v0.33/0010).

The stage 1 that the grouped launcher runs for a 4-bit preset is compiled
for sm_90 by Triton's own compiler (no GPU needed) and its TTGIR read: in the
token loop, no floating-point tile of the cache's head-dimension width may
go through shared memory. Before the patch the dequantized fp16 key and
value tiles are the MMA's B operand, stored to shared memory every tile;
with it the tokens are the MMA's M rows, the code bytes go through shared
memory and are dequantized in each thread's A-operand fragment.

The 4-bit keys' centroids come from a table in inline PTX on CUDA, which
Triton's interpreter cannot run: an emulator of its few instructions runs
it here on every four codes.
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

import numpy as np
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


# --------------------------------------------------------------------------
# The centroid table in PTX, run here by an emulator of its instructions
# --------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF


def prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray | int) -> np.ndarray:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte
    ``sel[4i:4i+3]`` of {b, a} (a the low word), or that byte's sign bit
    replicated where ``sel[4i+3]`` is set."""
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    sel = np.broadcast_to(np.asarray(sel, dtype=np.uint64), pool.shape)
    out = np.zeros(pool.shape, dtype=np.uint64)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(nib & np.uint64(8), sign, byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """PTX ``lop3.b32``: bit i of the result is bit (a_i b_i c_i) of ``lut``."""
    out = np.zeros_like(a)
    for k in range(8):
        if lut >> k & 1:
            t = [x if k >> s & 1 else ~x for s, x in ((2, a), (1, b), (0, c))]
            out |= t[0] & t[1] & t[2]
    return out


def ptx_step(op: str, s: list, src: list[str], shape: tuple) -> np.ndarray:
    """One instruction of ``run_ptx`` on its source values ``s``."""
    if op == "and.b32":
        return s[0] & s[1]
    if op == "or.b32":
        return s[0] | s[1]
    if op == "shr.b32":
        return s[0] >> s[1]
    if op == "shl.b32":
        return s[0].astype(np.uint64) << s[1] & MASK32
    if op == "mov.b32":
        return np.broadcast_to(s[0], shape)
    if op == "prmt.b32":
        return prmt(s[0], s[1], s[2])
    if op == "lop3.b32":
        return lop3(s[0], s[1], s[2], int(src[3], 0))
    raise AssertionError(f"the emulator has no {op}")


def run_ptx(ptx: str, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inline PTX of ``_fp16_table_ptx`` on packed codes ($2, uint32):
    ($0, $1). Only the instructions it uses; anything else is an error."""
    regs: dict[str, np.ndarray] = {"$2": codes.astype(np.uint32)}
    body = ptx[ptx.index(";") + 1 : ptx.rindex("}")]  # past the .reg line
    for ins in filter(None, (i.strip() for i in body.split(";"))):
        op, args = ins.split(None, 1)
        d, *src = (x.strip() for x in args.split(","))
        s = [regs[x] if x in regs else np.uint32(int(x, 0)) for x in src]
        regs[d] = ptx_step(op, s, src, codes.shape).astype(np.uint32)
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("head", [64, 128, 256])
def test_ptx_centroid_table_gives_each_codes_entry(vllm_tree: Path, head: int) -> None:
    """The PTX the registers stage 1 takes on CUDA for 4-bit keys (a table
    of the centroids' fp16 high parts, and one of their low parts), run by
    an emulator of its instructions on every four codes (16**4 words): each
    code's fp16 entry, in the order the MMA fragment packs them (codes 0
    and 1 in $0, 2 and 3 in $1, the first in the low half). Triton's
    interpreter runs no PTX, so the other CPU tests take the gather."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    c = get_centroids(head, 4).float()
    entries = {"high": c.half(), "low": (c - c.half().float()).half()}
    tables = dict(zip(entries, gd._centroid_tables_ptx(head, 4)))
    quads = np.arange(1 << 16, dtype=np.uint32)
    codes = sum(((quads >> (4 * i)) & 0xF) << (8 * i) for i in range(4))
    for part, table in tables.items():
        bits = entries[part].view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
        want = [bits[(quads >> (4 * i)) & 0xF] for i in range(4)]
        got = run_ptx(table, codes.astype(np.uint32))
        pairs = [(got[0] & 0xFFFF, got[0] >> 16), (got[1] & 0xFFFF, got[1] >> 16)]
        wrong = sum(int((g != w).sum()) for g, w in zip(sum(pairs, ()), want))
        assert not wrong, (
            f"the PTX centroid table gives other entries than the centroids' "
            f"{part} parts: {wrong} of {4 << 16} codes wrong (D {head})"
        )
