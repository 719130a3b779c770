"""The tensor cores' fp16 MMA rounding against its CPU emulation (issue 35).

tests/patches/test_tq_grouped_decode.py::test_long_split_error_flat runs the
grouped decode in Triton's interpreter with ``tqharness.mma_truncating`` as
``tl.dot``: products and accumulator aligned to the largest exponent, 2 guard
bits, truncated toward zero, 16 products a step. This script holds that
model to the GPU: ``tl.dot(a, b, acc)`` at the grouped decode's PV shape
([16, 64] x [64, 32] fp16 into fp32, 4 warps) on random operands, and a
chain of 512 such dots of one-signed products (the sum the decode carries),
each against the emulation and against numpy's fp32 rounded to nearest.

    python ci/gpu/tc_rounding_check.py [--out FILE.json] [--save FILE.npz]
    python ci/gpu/tc_rounding_check.py --load FILE.npz   # a saved run, on CPU

Prints, per case, the share of outputs bit-equal to each model, the largest
difference in fp32 ulps, and for the chain the relative drift from float64.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "patches"))
import tqharness as h

M, K, N, STEPS = 16, 64, 32, 512


@triton.jit
def _dot_chain(A, B, C, Out, steps, K: tl.constexpr, N: tl.constexpr):
    """acc = C; for each step s: acc = dot(A[s], B[s], acc); Out = acc."""
    rm = tl.arange(0, 16)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    acc = tl.load(C + rm[:, None] * N + rn[None, :])
    for s in range(steps):
        a = tl.load(A + s * 16 * K + rm[:, None] * K + rk[None, :])
        b = tl.load(B + s * K * N + rk[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(Out + rm[:, None] * N + rn[None, :], acc)


def gpu_chain(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ta, tb_, tc = (torch.from_numpy(x).to(dev) for x in (a, b, c))
    out = torch.empty_like(tc)
    _dot_chain[(1,)](ta, tb_, tc, out, a.shape[0], K=K, N=N, num_warps=4)
    return out.cpu().numpy()


def models(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict[str, np.ndarray]:
    trunc, near = c.copy(), c.copy()
    for s in range(a.shape[0]):
        trunc = h.mma_truncating(a[s], b[s], trunc)
        near = (a[s].astype(np.float32) @ b[s].astype(np.float32) + near).astype(
            np.float32
        )
    return {"truncating": trunc, "nearest": near}


def ulps(x: np.ndarray, y: np.ndarray) -> int:
    xi, yi = (v.astype(np.float32).view(np.int32).astype(np.int64) for v in (x, y))
    return int(np.abs(xi - yi).max())


SAVED: dict[str, np.ndarray] = {}


LOADED: dict[str, np.ndarray] = {}


def case(name: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict:
    got = LOADED.get(f"{len(SAVED) // 4}_g")
    got = gpu_chain(a, b, c) if got is None else got
    SAVED.update({f"{len(SAVED) // 4}_{k}": v for k, v in zip("abcg", (a, b, c, got))})
    exact = c.astype(np.float64) + np.einsum(
        "smk,skn->mn", a.astype(np.float64), b.astype(np.float64)
    )
    row = {"case": name, "steps": int(a.shape[0])}
    for model, want in models(a, b, c).items():
        same = got.view(np.int32) == want.view(np.int32)
        row[f"equal_{model}"] = float(same.mean())
        row[f"max_ulps_{model}"] = ulps(got, want)
        row[f"drift_{model}"] = float(((want - exact) / np.abs(exact).max()).mean())
    row["drift_gpu"] = float(((got - exact) / np.abs(exact).max()).mean())
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--save", type=Path, help="every case's inputs and GPU output (.npz)"
    )
    p.add_argument("--load", type=Path, help="a --save file: its GPU outputs, no GPU")
    args = p.parse_args()
    if args.load:
        LOADED.update(np.load(args.load))
    rng = np.random.default_rng(0)
    rows = []
    for scale in (1e-3, 1.0, 1e3):
        a = rng.standard_normal((1, M, K)).astype(np.float16)
        b = rng.standard_normal((1, K, N)).astype(np.float16)
        c = (scale * rng.standard_normal((M, N))).astype(np.float32)
        rows.append(case(f"one dot, |acc| ~ {scale:g}", a, b, c))
    # The decode's PV sum: p x scale >= 0 times value codes 0-15, 512 tiles.
    a = np.abs(rng.standard_normal((STEPS, M, K)) / K).astype(np.float16)
    b = rng.integers(0, 16, (STEPS, K, N)).astype(np.float16)
    rows.append(case("chain, one-signed", a, b, np.zeros((M, N), np.float32)))
    for r in rows:
        print(
            f"{r['case']:28s} steps {r['steps']:4d}  bit-equal: truncating "
            f"{r['equal_truncating']:.4f} (max {r['max_ulps_truncating']} ulp), "
            f"nearest {r['equal_nearest']:.4f} (max {r['max_ulps_nearest']} ulp); "
            f"drift gpu {r['drift_gpu']:.3e} truncating "
            f"{r['drift_truncating']:.3e} nearest {r['drift_nearest']:.3e}"
        )
    if args.save:
        np.savez_compressed(args.save, **SAVED)
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
