"""The grouped TurboQuant decode's stage 1 as CUDA compiles it, on a machine
without a GPU: the launch the backend makes for a decode step (recorded, not
run), compiled for sm_90 by Triton's own compiler in a child process, and an
emulator of the few PTX instructions its inline tables use, so their every
input can be checked here (Triton's interpreter runs no PTX)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tqbatches as tb

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
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec["aligned"]}
src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
print(k.asm[spec["asm"]])
"""


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


def step_launches(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The kernel launches of the grouped launcher for a decode step (two
    splits), recorded, not run."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    launches = Launches()
    # What it launches on CUDA (inline PTX), not in the interpreter.
    monkeypatch.setattr(gd, "_use_ptx", lambda device: True, raising=False)
    for name in dir(gd):
        if name.startswith("_tq_grouped_decode_"):
            monkeypatch.setattr(gd, name, launches.kernel(name, getattr(gd, name)))
    impl, layer, batch = tb.decode_batch(env, [300, 40], seed=3)
    tb.decode_kernels(impl, layer, batch, splits=2, old_splits=None)
    return launches.calls


def stage1_launch(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The stage-1 launch of the grouped launcher for a decode step."""
    (call,) = [c for c in step_launches(env, monkeypatch) if "stage1" in c["kernel"]]
    return call


def stage1_config(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch, many: bool
) -> tuple[str, int, int, bool]:
    """``stage1_launch`` with few programs (32 SMs) or many
    (``_many_programs``: 2 SMs): (kernel, BLOCK_KV, num_warps, register cap),
    the kernel's name without ``_tq_grouped_decode_``."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    monkeypatch.setattr(gd, "_num_sms", lambda device: 2 if many else 32)
    call = stage1_launch(env, monkeypatch)
    kw, kernel = call["kwargs"], call["kernel"].removeprefix("_tq_grouped_decode_")
    return kernel, kw["BLOCK_KV"], kw.get("num_warps", 4), "maxnreg" in kw


def compile_spec(call: dict, asm: str = "ttgir", aligned: bool = False) -> dict:
    """The launch as the child's JSON: kernel, argument types, constexprs, the
    output wanted (``asm``: ttgir, ptx, ...). ``aligned``: the arguments
    Triton's launcher would mark divisible by 16 (pointers at 16-byte
    addresses, integers that are multiples of 16), as on a GPU."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    fn = getattr(gd, call["kernel"]).arg_names
    names = [a for a in fn if a not in call["kwargs"]]
    types, sixteen = {}, []
    for name, arg in zip(names, call["args"]):
        if isinstance(arg, torch.Tensor):
            types[name] = POINTER[arg.dtype]
            value = arg.data_ptr()
        else:
            types[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            value = arg
        if aligned and value % 16 == 0:
            sixteen.append(name)
    options = {k: v for k, v in call["kwargs"].items() if k not in fn}
    const = {k: v for k, v in call["kwargs"].items() if k in fn}
    return {"kernel": call["kernel"], "types": types, "constexprs": const,
            "options": options, "asm": asm, "aligned": sixteen}  # fmt: skip


def compile_stage1(spec: dict, vllm_tree: Path) -> str:
    """``spec`` (``compile_spec``) compiled in a child process: its asm text."""
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child["PYTHONPATH"] = os.pathsep.join([str(vllm_tree), child.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(spec)],
        capture_output=True, text=True, env=child, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def ptx_loop(ptx: str) -> list[str]:
    """The instructions of the PTX's longest loop (from a label to the last
    branch back to it)."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {m[1]: i for i, line in enumerate(lines)
              if (m := re.match(r"(\$L__BB\d+_\d+):", line))}  # fmt: skip
    spans = [(i - labels[m[1]], labels[m[1]], i) for i, line in enumerate(lines)
             if (m := re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line))
             and labels.get(m[1], i) < i]  # fmt: skip
    _, start, end = max(spans)
    return [x for x in lines[start:end] if re.match(r"[a-z@]", x)]


# --------------------------------------------------------------------------
# An emulator of the inline PTX's instructions
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
    a, b, c = np.broadcast_arrays(np.uint32(a), np.uint32(b), np.uint32(c))
    out = np.zeros(a.shape, dtype=np.uint32)
    for k in range(8):
        if lut >> k & 1:
            t = [x if k >> s & 1 else ~x for s, x in ((2, a), (1, b), (0, c))]
            out |= t[0] & t[1] & t[2]
    return out


def sub_f16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PTX ``sub.rn.f16x2``: each fp16 half of ``a`` minus that of ``b``."""
    a, b = np.broadcast_arrays(np.uint32(a), np.uint32(b))
    pairs = [(x.astype(np.uint16).view(np.float16), y.astype(np.uint16).view(np.float16))
             for x, y in ((a & 0xFFFF, b & 0xFFFF), (a >> 16, b >> 16))]  # fmt: skip
    lo, hi = ((x - y).view(np.uint16).astype(np.uint32) for x, y in pairs)
    return lo | (hi << 16)


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
    if op == "sub.rn.f16x2":
        return sub_f16x2(s[0], s[1])
    raise AssertionError(f"the emulator has no {op}")


def run_ptx(ptx: Any, words: np.ndarray, first_in: int = 2) -> tuple[np.ndarray, ...]:
    """Inline PTX (a str or Triton constexpr) of one 32-bit input
    (``$first_in``, here ``words``) and ``first_in`` 32-bit outputs ($0, $1,
    ...): only the instructions of ``ptx_step``; anything else is an error."""
    regs: dict[str, np.ndarray] = {f"${first_in}": words.astype(np.uint32)}
    body = str(getattr(ptx, "value", ptx)).strip()
    if body.startswith("{"):  # a scope: past its .reg line, to its end
        body = body[body.index(";") + 1 : body.rindex("}")]
    for ins in filter(None, (i.strip() for i in body.split(";"))):
        op, args = ins.split(None, 1)
        d, *src = (x.strip() for x in args.split(","))
        s = [regs[x] if x in regs else np.uint32(int(x, 0)) for x in src]
        regs[d] = ptx_step(op, s, src, words.shape).astype(np.uint32)
    return tuple(regs[f"${i}"] for i in range(first_in))
