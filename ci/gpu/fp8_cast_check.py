"""Triton's fp8 casts on the GPU against their CPU emulation (issue 35).

The TurboQuant store kernel casts k8v4 keys to fp8 (``x.to(tl.float8e4nv)``).
Triton's interpreter (3.9) casts wrongly where rounding carries into the
exponent; the CPU tests use ``tqharness.exact_fp8_casts``, which casts with
``tqharness.fp8_bits`` (torch's round to nearest even, saturated to the
largest finite value). This script holds ``fp8_bits`` to a GPU: every finite
fp16 and bf16 value, 2^20 random fp32 values over 2^-20 .. 2^17 and both
signs, and every midpoint between two fp8 values (the ties), each cast by a
Triton kernel to fp8e4nv and fp8e5, byte for byte. On CPU it runs the same
kernel in the interpreter, as it is and with ``exact_fp8_casts``.

    python ci/gpu/fp8_cast_check.py [--out FILE.json]

Prints one line per (input dtype, format, cast): values, bytes equal to
``fp8_bits``, and the first few that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "patches"))
import tqharness as h

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024


@triton.jit
def _cast(X, Y, n, E5: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(X + o, mask=m)
    y = x.to(tl.float8e5) if E5 else x.to(tl.float8e4nv)
    tl.store(Y + o, y.to(tl.uint8, bitcast=True), mask=m)


def inputs() -> dict[str, torch.Tensor]:
    """The values, by input dtype."""
    g = torch.Generator().manual_seed(0)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    f16, bf16 = bits.view(torch.float16), bits.view(torch.bfloat16)
    mags = torch.exp2(torch.rand(2**20, generator=g) * 37 - 20)
    signs = torch.randint(0, 2, (2**20,), generator=g) * 2 - 1
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ties = []
    for dtype, _ in h.FP8.values():
        v = codes.view(dtype).float()
        v = v[v.isfinite()].unique()
        ties.append((v[1:] + v[:-1]) / 2)
    return {
        "fp16": f16[f16.isfinite()],
        "bf16": bf16[bf16.float().isfinite()],
        "fp32": torch.cat([mags * signs, *ties]),
    }


def check(x: torch.Tensor, fmt: str) -> dict:
    y = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    xd = x.to(DEVICE)
    _cast[(triton.cdiv(x.numel(), BLOCK),)](
        xd, y, x.numel(), E5=fmt == "fp8e5", BLOCK=BLOCK
    )
    want = h.fp8_bits(x, fmt)
    bad = (y.cpu() != want).nonzero().flatten()
    first = [(x[i].item(), int(y[i]), int(want[i])) for i in bad[:5].tolist()]
    return {"values": x.numel(), "equal": x.numel() - bad.numel(), "first": first}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    casts = ["gpu"] if DEVICE == "cuda" else ["interpreter", "exact_fp8_casts"]
    rows = []
    for cast in casts:
        if cast == "exact_fp8_casts":
            h.exact_fp8_casts()
        for name, x in inputs().items():
            for fmt in h.FP8:
                r = {"cast": cast, "input": name, "format": fmt, **check(x, fmt)}
                print(json.dumps(r))
                rows.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
