"""Issue 54's side-by-side columns for the decode accuracy suite
(tq_decode_accuracy.py --fa2 [--goal NAME]): FlashAttention-2's decode over
a bf16 (or fp16) cache of the same tokens, the compressed floor, and which
of the issue's goals a kernel meets in each cell.

  fa2    PyTorch's aten._flash_attention_forward over a dense batch of B x L
         tokens (Hk KV heads, random values: its time does not depend on
         them), the queries of the suite's dtype, CUDA-graph replayed with
         L2 flushed like the others; one K/V buffer a head size, timed once
         a (D, GQA, B, L) and reused across presets
  floor  the cell's compressed K/V bytes (B x L x Hk x slot) over the
         device's measured copy rate (tqlib.ceilings)

Goals (issue 54), at B >= 8 and L >= 32K: turboquant_4bit_nc at most 2x its
floor and faster than FA2 (at least 1.3x at B >= 32); k8v4 at most 1.6x its
floor; 3bit_nc and k3v4_nc at most 3x their floor and no slower than FA2.
Everywhere: faster than the peer (vllm#53060) where both run, and at B = 1
no slower than FA2; every error within the suite's bound.
"""

from __future__ import annotations

import math

import torch
import tqlib
from tqlib import h

# preset: (x floor, x FA2) at B >= 8 and L >= 32K (None: no FA2 goal)
GOALS = {"4bit_nc": (2.0, 1.0), "k8v4": (1.6, None), "3bit_nc": (3.0, 1.0),
         "k3v4_nc": (3.0, 1.0)}  # fmt: skip
FAST_4BIT = 1 / 1.3  # turboquant_4bit_nc's x FA2 at B >= 32


def setup(env) -> None:
    """The copy rate for the floor; FA2's times (``env.fa2_ms``, also the
    suite's --fa2 switch) and buffer, empty."""
    env.ceil = tqlib.ceilings()
    env.fa2_ms, env.fa2_kv = {}, None


def reserve(env, d: int, gqas, cells: list, dtype: torch.dtype) -> None:
    """``env.fa2_kv``: a K/V buffer for head size ``d`` (the caller drops
    it), as many tokens as the largest of ``cells`` not yet timed that a
    third of the free memory holds (none on CPU)."""
    env.fa2_kv = None
    todo = [
        (b, n) for b, n in cells if any((d, g, b, n) not in env.fa2_ms for g in gqas)
    ]
    if not tqlib.HAS_CUDA or not todo:
        return
    third = torch.cuda.mem_get_info()[0] // 3
    tokens = [b * n for b, n in todo if b * n * env.hk * d * 4 <= third]
    if tokens:
        kv = torch.empty(2, max(tokens), env.hk, d, dtype=dtype, device=tqlib.DEVICE)
        env.fa2_kv = kv.normal_()


def times(env, shape, batch: int, length: int, reps: int) -> dict:
    """The cell's floor and FA2's time (timed once a D, GQA and cell)."""
    import tq_decode_bench as bench

    hk, d = env.hk, shape.d
    slot = h.tq_slot_size(f"turboquant_{shape.preset}", d)
    out = {"floor_ms": batch * length * hk * slot / env.ceil["copy_bytes_per_s"] * 1e3}
    key = (d, shape.gqa, batch, length)
    kv = env.fa2_kv
    if key not in env.fa2_ms and kv is not None and kv.shape[1] >= batch * length:
        g = torch.Generator(device=tqlib.DEVICE).manual_seed(batch + length)
        q = tqlib.rand((batch, 1, shape.hq, d), kv.dtype, g)
        k = kv[0, : batch * length].view(batch, length, hk, d)
        v = kv[1, : batch * length].view(batch, length, hk, d)
        fa = torch.ops.aten._flash_attention_forward

        def dense():
            fa(q, k, v, None, None, 1, length, 0.0, False, False, scale=d**-0.5)

        try:
            env.fa2_ms[key] = bench.graph_time(dense, env.flush, reps)["median_ms"]
        except Exception as e:  # recorded in the row, the others go on
            out["fa2_error"] = f"{type(e).__name__}: {e}"[:300]
    if key in env.fa2_ms:
        out["fa2_ms"] = env.fa2_ms[key]
    return out


def misses(row: dict, name: str) -> list[str]:
    """The goals ``name`` misses in ``row`` (a suite row), in words."""
    r, out = row.get(name), []
    if not r or "ms" not in r:
        return ["not run"]
    ms, fa2, floor = r["ms"], row.get("fa2_ms"), row.get("floor_ms")
    if not r["within_bound"]:
        out.append("error over the bound")
    peer = row.get("peer", {}).get("ms")
    if peer and ms >= peer:
        out.append(f"{ms / peer:.2f}x peer")
    if row["B"] == 1 and fa2 and ms > fa2:
        out.append(f"B 1: {ms / fa2:.2f}x FA2")
    if row["B"] < 8 or row["L"] < 32768 or row["preset"] not in GOALS:
        return out
    x_floor, x_fa2 = GOALS[row["preset"]]
    if floor and ms > x_floor * floor:
        out.append(f"{ms / floor:.1f}x floor (goal {x_floor})")
    if row["preset"] == "4bit_nc" and row["B"] >= 32:
        x_fa2 = FAST_4BIT
    if x_fa2 and fa2 and ms > x_fa2 * fa2:
        out.append(f"{ms / fa2:.2f}x FA2 (goal {x_fa2:.2f})")
    return out


def lines(res: dict, name: str) -> list[str]:
    """The side-by-side table of ``name`` against v0.33.0, the peer, FA2 and
    the floor, a row a cell, with the goals it misses."""
    others = [n for n in res["kernels"] if n not in ("up", name)]
    head = (["data", "preset", "D", "GQA", "B x L", "floor", "fa2", "up"]
            + others + [name, f"{name}/floor", f"{name}/fa2"]
            + ([f"{name}/peer"] if "peer" in others else []) + ["goals missed"])  # fmt: skip
    title = (f"### {name} beside v0.33.0 (up), {', '.join(others)} and FA2, ms "
             "(issue 54's goals: ci/gpu/tq_goal.py)")  # fmt: skip
    out = ["", title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = 0
    for row in res["rows"]:
        ms = {n: row.get(n, {}).get("ms", math.nan) for n in ["up", *others, name]}
        fa2, floor = row.get("fa2_ms", math.nan), row.get("floor_ms", math.nan)
        ratios = [ms[name] / floor, ms[name] / fa2]
        ratios += [ms[name] / ms["peer"]] if "peer" in others else []
        miss = misses(row, name)
        met += not miss
        cells = [row.get("data", ""), row["preset"], row["D"], row["GQA"],
                 f"{row['B']} x {row['L']}", f"{floor:.3f}", f"{fa2:.3f}"]  # fmt: skip
        cells += [f"{ms[n]:.3f}" for n in ["up", *others, name]]
        cells += [f"{x:.2f}" for x in ratios] + ["; ".join(miss) or "-"]
        out.append("| " + " | ".join(str(c).replace("nan", "-") for c in cells) + " |")
    out.append(f"\n{name}: cells missing no goal: {met} of {len(res['rows'])}")
    return out
