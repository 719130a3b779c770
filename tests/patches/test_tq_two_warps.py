"""The grouped decode's registers stage 1 on two warps where its accumulators
do not fit one (tq-v0.33/0015).

At head size 256 with 9-16 query heads a KV head the registers stage 1's
two fp32 accumulators ([128, 16] each) take 128 registers a lane of one
warp, so 0012 kept 3-bit keys (turboquant_3bit_nc, k3v4_nc) on 0009's first
stage 1 there, and 0011 kept fp16 queries there for every MSE preset: each
code's centroid gathered from memory and split into fp16 high and low
parts. The patch runs those presets on the registers stage 1 with 32
tokens a step over two warps, which split the accumulators, and without
the register cap (spill-free at about 250 registers): on an H200 at
0.6-0.85x the first stage 1's time (ci/gpu/NOTES.md). 4-bit keys with bf16
queries keep their configuration (uncapped two warps were slower); fp16
queries on 3-bit keys' slots keep the first stage 1 (the two warps were
slower there).

The regression test records the stage-1 launch the backend makes for a
decode step (not run, as CUDA would launch it: with inline PTX), with few
and with many programs; the others check the shapes the patch leaves
alone, and run the step's decode in Triton's interpreter against float64
attention over the K/V the cache holds, beside v0.33.0's kernel.
"""

from __future__ import annotations

import pytest
import torch
import tqbatches as tb
from tqptx import stage1_config

FIRST = r"^turboquant_\w+ with \w+ queries runs the first stage 1 at head size 256"
BF16, FP16 = torch.bfloat16, torch.float16
# (preset, query dtype) the patch moves to two warps, and two it leaves.
TWO_WARPS = [("turboquant_3bit_nc", BF16), ("turboquant_k3v4_nc", BF16),
             ("turboquant_4bit_nc", FP16)]  # fmt: skip
KEPT = [("turboquant_4bit_nc", BF16), ("turboquant_3bit_nc", FP16)]


# The tree's backend at head size 256 with 16 query heads a KV head.
env = tb.cases_fixture("two_warps", hq=16, hk=1, head=256)


@pytest.mark.bug_signature(AssertionError, FIRST)
@tb.env_cases(TWO_WARPS)
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_two_warps_where_accumulators_do_not_fit_one(
    env: tb.Backend, many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3-bit keys with bf16 queries, and 4-bit keys with fp16 queries, run
    the registers stage 1: 32 tokens a step on two warps, uncapped."""
    preset, dtype = env.shape.preset, env.shape.dtype
    got = stage1_config(env, monkeypatch, many)
    if got[0] == "stage1":
        raise AssertionError(
            f"{preset} with {str(dtype)[6:]} queries runs the first stage 1 at "
            "head size 256 with 16 query heads a KV head (each code's centroid "
            "gathered from memory), not the registers stage 1 on two warps"
        )
    assert got == ("regs_stage1", 32, 2, False), f"launch: {got}"


@tb.env_cases(KEPT)
@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_other_shapes_kept(
    env: tb.Backend, many: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4-bit keys with bf16 queries keep one warp under the cap (on
    turboquant_soa's pages with many programs: 32 tokens on two warps,
    capped; from tq-v0.33/0022 with fewer programs too); fp16 queries on
    3-bit keys keep the first stage 1."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    got = stage1_config(env, monkeypatch, many)
    if env.shape.dtype == FP16:
        assert got[0] == "stage1", f"launch: {got}"
    elif hasattr(gd, "_REGS_FEW_WAVES"):
        assert got == ("regs_stage1", 32, 2, True), f"launch: {got}"
    else:
        assert got == (("regs_stage1", 32, 2, True) if many else
                       ("regs_stage1", 16, 1, False)), f"launch: {got}"  # fmt: skip


@tb.env_cases(TWO_WARPS)
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode (Triton's interpreter) against float64
    attention over the K/V the cache holds: its largest error at most 1.25x
    v0.33.0's kernel's on the same cache (the decode accuracy suite's bound;
    both near an ulp of the bf16 output here)."""
    tb.check_regs_step(env)
