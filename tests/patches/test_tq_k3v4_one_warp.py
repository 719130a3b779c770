"""3-bit keys on turboquant_soa's pages keep 16 tokens a step on one warp at
head size 256 (tq-v0.33/0018).

0011 runs MSE keys on turboquant_soa's pages at head size 256 with many
programs on 32 tokens a step over two warps (``_REGS_SOA_WIDE``, measured
for turboquant_4bit_nc). Since 0017 turboquant_k3v4_nc's pages are SoA
pages too, so the rule took it, where on slots it ran 16 tokens on one
warp; on an H200 one warp took 0.81-0.95x the two warps' time with bf16
queries, 0.92-1.00x with fp16 (ci/gpu/NOTES.md). The patch keeps the two
warps for 4-bit MSE keys (and FP8 keys with groups of 16) only.

The regression test records the stage-1 launch the backend makes for a
decode step with many programs (not run, as CUDA would launch it); the
others check 4-bit keys keep two warps and run the step's decode in
Triton's interpreter against float64 attention over the K/V the cache
holds, beside v0.33.0's kernel.
"""

from __future__ import annotations

import pytest
import torch
import tqbatches as tb
from tqptx import stage1_config

TWO = r"^turboquant_k3v4_nc with \w+ queries runs 32 tokens a step on two warps"
BF16, FP16 = torch.bfloat16, torch.float16
THREE_BIT = [("turboquant_k3v4_nc", BF16), ("turboquant_k3v4_nc", FP16)]
FOUR_BIT = [("turboquant_4bit_nc", BF16), ("turboquant_4bit_nc", FP16)]

# The tree's backend at head size 256 with 4 query heads a KV head.
env = tb.cases_fixture("one_warp", hq=8, hk=2, head=256)


@pytest.mark.bug_signature(AssertionError, TWO)
@tb.env_cases(THREE_BIT)
def test_three_bit_keys_on_one_warp(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many programs the step launches the registers stage 1 with 16
    tokens on one warp, under the register cap, as with few."""
    got = stage1_config(env, monkeypatch, many=True)
    if got[1:3] == (32, 2):
        raise AssertionError(
            f"{env.shape.preset} with {str(env.shape.dtype)[6:]} queries runs "
            "32 tokens a step on two warps at head size 256 with many programs "
            "(the step measured for 4-bit keys), not 16 on one"
        )
    assert got == ("regs_stage1", 16, 1, True), f"launch: {got}"


@tb.env_cases(FOUR_BIT)
def test_four_bit_keys_keep_two_warps(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """turboquant_4bit_nc keeps 32 tokens on two warps there."""
    got = stage1_config(env, monkeypatch, many=True)
    assert got == ("regs_stage1", 32, 2, True), f"launch: {got}"


@tb.env_cases(THREE_BIT[:1])
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode with many programs (Triton's
    interpreter) against float64 attention over the K/V the cache holds:
    its largest error at most 1.25x v0.33.0's kernel's on the same cache
    (the decode accuracy suite's bound)."""
    tb.check_regs_step(env, many=True)
