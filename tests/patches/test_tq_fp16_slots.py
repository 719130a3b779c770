"""fp16 queries on 3-bit keys' slots take the registers stage 1 at every
batch up to head size 128 (tq-v0.33/0016).

The registers stage 1 with fp16 queries needs the centroids' low parts
too; 0010 ran it only below ``_many_programs`` on slots (with 4-bit keys,
then on slots, it was slower there) and 0011 at every batch on
turboquant_soa's pages, where 4-bit keys now live. 3-bit keys
(turboquant_3bit_nc, k3v4_nc) keep slots, so with many programs they ran
the first stage 1: each code's centroid gathered from memory, at 1.1-1.7x
the registers stage 1's time on an H200 at head size 128 once 0014 loaded
their codes as words (ci/gpu/NOTES.md). The patch runs them on the
registers stage 1 at every batch up to head size 128; at 256 the first
stays (k3v4_nc was slower on the registers one there).

The regression test records the stage-1 launch the backend makes for a
decode step with many programs (not run, as CUDA would launch it); the
others check the head size 256 rule and run the step's decode in Triton's
interpreter against float64 attention over the K/V the cache holds, beside
v0.33.0's kernel.
"""

from __future__ import annotations

import pytest
import torch
import tqbatches as tb
from tqptx import stage1_config

FIRST = r"^fp16 queries on turboquant_\w+'s slots run the first stage 1"
FP16 = torch.float16
SHAPES = [("turboquant_3bit_nc", FP16), ("turboquant_k3v4_nc", FP16)]


# The tree's backend at head size 128 with 4 query heads a KV head.
env = tb.cases_fixture("fp16", hq=8, hk=2, head=128)


@pytest.mark.bug_signature(AssertionError, FIRST)
@tb.env_cases(SHAPES)
def test_fp16_three_bit_keys_on_registers_at_many_programs(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many programs the step launches the registers stage 1 (16 tokens
    on one warp, under the register cap), as with few (uncapped, until
    tq-v0.33/0023 puts them in whole waves of the capped launch)."""
    got = stage1_config(env, monkeypatch, many=True)
    if got[0] == "stage1":
        raise AssertionError(
            f"fp16 queries on {env.shape.preset}'s slots run the first stage 1 "
            "with many programs (each code's centroid gathered from memory), "
            "not the registers stage 1"
        )
    assert got == ("regs_stage1", 16, 1, True), f"launch: {got}"
    few = stage1_config(env, monkeypatch, many=False)
    capped = env.impl()._grouped_in_registers
    assert few == ("regs_stage1", 16, 1, capped), f"launch with few: {few}"


def test_head_size_256_keeps_first_stage1() -> None:
    """At head size 256 slots keep the first stage 1 with many programs (and
    at 16 query heads a KV head with few); turboquant_soa's pages do not."""
    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        _registers_small_batch as regs,
    )

    assert regs(128, 4, True) and regs(64, 16, True) and regs(128, 8, True)
    assert not regs(256, 4, True) and regs(256, 4, False)
    assert not regs(256, 16, False) and regs(256, 16, True, soa=True)
    assert regs(256, 4, True, soa=True)


@tb.env_cases(SHAPES)
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode with many programs (Triton's
    interpreter) against float64 attention over the K/V the cache holds:
    its largest error at most 1.25x v0.33.0's kernel's on the same cache
    (the decode accuracy suite's bound)."""
    tb.check_regs_step(env, many=True)
