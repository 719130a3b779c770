"""fp16 queries on MSE keys in the registers stage 1's whole waves at every
batch (tq-v0.33/0023).

With fp16 queries the registers stage 1 adds the centroids' low parts (a
second MMA a key tile), so ``grouped_decode_in_registers`` said no for
them: the backend took splits for 8 programs a SM, and fewer programs than
``_many_programs`` ran uncapped. At 16 requests x 4 KV heads on an H100
that is 1,088 programs, 32 more than the 1,056 slots 8 a SM give, and
turboquant_4bit_nc took 1.78x fp16 FlashAttention's time at head size 128
(bf16 queries: 0.65x bf16's). The patch gives fp16 queries on MSE keys the
launch and split count of bf16 queries up to head size 128: on an H100
0.61-0.87x the time at 16 and 32 requests, 0.93-0.99x at 1 x 128K and 128
x 32K (head sizes 64 and 128, GQA 4, 8 and 16; ci/gpu/NOTES.md). Head
size 256 keeps its launches (1.16-1.29x their time at one request).

The regression test asks the split count the backend takes for a decode
step with fp16 queries at an H100's SM count: whole waves of the programs
the register cap leaves resident. The others record the stage-1 launch
(not run) and run the step's decode in Triton's interpreter against
float64 attention over the K/V the cache holds, beside v0.33.0's kernel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import tqbatches as tb
from tqptx import stage1_config

RESIDENT, splits = tb.REGS_RESIDENT, tb.step_splits
PART_WAVES = r"^turboquant_\w+ with fp16 queries at head size \d+ takes \d+ splits"
FP16 = torch.float16
MSE = [("turboquant_4bit_nc", FP16), ("turboquant_k3v4_nc", FP16),
       ("turboquant_3bit_nc", FP16)]  # fmt: skip

# The tree's backend at head size 128 with 4 query heads a KV head.
env = tb.cases_fixture("f16w", hq=8, hk=2, head=128)


@pytest.mark.bug_signature(AssertionError, PART_WAVES)
@pytest.mark.parametrize("requests", [1, 16, 32])
@tb.env_cases(MSE)
def test_fp16_fills_whole_waves(
    env: tb.Backend, gd: Any, monkeypatch: pytest.MonkeyPatch, requests: int
) -> None:
    """The backend's split count for a decode step with fp16 queries on MSE
    keys (4 KV heads, 132 SMs) fills whole waves of the programs the
    register cap leaves resident, but for less than one split's programs."""
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    s = splits(gd, requests, 4, env.impl()._grouped_in_registers)
    programs, wave = requests * 4, RESIDENT * 132
    slack = -(programs * s) % wave
    if slack >= programs:
        raise AssertionError(
            f"{env.shape.preset} with fp16 queries at head size 128 takes {s} "
            f"splits for {requests} requests x 4 KV heads on 132 SMs: "
            f"{programs * s} programs, {slack} of the last wave's {wave} slots "
            f"of {RESIDENT} programs a SM the register cap leaves empty"
        )


@tb.env_cases(MSE)
def test_fp16_takes_the_capped_launch(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fewer programs the step launches the registers stage 1 as with
    many: one warp under the register cap, 16 tokens a step (32 spill with
    the low parts at head size 128)."""
    got = stage1_config(env, monkeypatch, many=False)
    assert got == ("regs_stage1", 16, 1, True), f"launch: {got}"


@pytest.mark.parametrize("group", [4, 8, 16])
def test_head_256_keeps_its_launches(gd: Any, group: int) -> None:
    """fp16 queries at head size 256 stay off the every-batch launch (one
    request took 1.16-1.29x the time there); bf16 queries keep it."""
    for mse_bits, value_bits in ((4, 4), (3, 4), (3, 3)):
        regs = gd.grouped_decode_in_registers(
            False, mse_bits, value_bits, FP16, 256, group
        )
        assert not regs, f"{mse_bits}-bit keys, {value_bits}-bit values, GQA {group}"
    assert gd.grouped_decode_in_registers(False, 4, 4, torch.bfloat16, 256, group)


@tb.env_cases(MSE)
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode with fp16 queries and fewer programs
    (Triton's interpreter) against float64 attention over the K/V the cache
    holds: its largest error at most 1.25x v0.33.0's kernel's on the same
    cache (the decode accuracy suite's bound)."""
    tb.check_regs_step(env)
