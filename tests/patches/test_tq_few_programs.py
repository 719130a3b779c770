"""The registers stage 1 with fewer programs: one whole wave of the capped
launch, and stage 2 merging 64 splits a step (tq-v0.33/0022).

Below half as many (request, KV head) programs as SMs (16 requests x 4
KV heads on an H100's 132 SMs) the registers stage 1 kept 0010's launch:
uncapped, 16 tokens a step, splits for 8 programs a SM. At 1 x 128K a
program walked 512 tokens in 32 dependent steps, 8 one-warp programs a SM
hid little latency, and stage 2 merged the 264 splits 16 at a time: 4bit_nc
took 1.37x bf16 FA2 there. The patch gives fewer programs the launch of
many (under the register cap, 32 tokens a step where they fit) with splits
that fill one whole wave of it, and stage 2 merges 64 splits a step: on an
H100 0.82-0.89x the time at 1 x 128K and 0.70-0.90x at 4-16 requests
(head size 128, GQA 4, the four presets; ci/gpu/NOTES.md).

The regression test asks the split count the backend takes for a decode
step with fewer programs at the GPUs' SM counts: its grid must fill one
wave of the capped programs but for less than one split's programs. The
others record the launches (not run): the capped stage 1, stage 2 merging
a wave's splits in few steps, fp16 queries on MSE keys keeping theirs
(until tq-v0.33/0023);
and run the step's decode in Triton's interpreter against float64
attention over the K/V the cache holds, beside v0.33.0's kernel.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import tqbatches as tb
from tqptx import stage1_config, step_launches

RESIDENT, splits = tb.REGS_RESIDENT, tb.step_splits
PART_WAVE = r"^\d+ splits for \d+ requests x \d+ KV heads on \d+ SMs fill \d+ of"
BF16, FP16 = torch.bfloat16, torch.float16
# (SMs, KV heads, requests): H100 and H200 (132), A100 (108), B200 (148);
# requests x KV heads below half the SMs.
FEW = [(132, 4, 1), (132, 4, 4), (132, 4, 8), (132, 4, 16), (132, 8, 8),
       (132, 1, 1), (108, 4, 8), (108, 2, 3), (148, 4, 16),
       (148, 8, 1)]  # fmt: skip
# (preset, query dtype): 32 tokens a step at head size 128, and 16.
WIDE = [("turboquant_4bit_nc", BF16), ("turboquant_k8v4", BF16),
        ("turboquant_k3v4_nc", BF16)]  # fmt: skip
REGS = [*WIDE, ("turboquant_3bit_nc", BF16)]

# The tree's backend at head size 128 with 4 query heads a KV head.
env = tb.cases_fixture("few", hq=8, hk=2, head=128)


@pytest.mark.bug_signature(AssertionError, PART_WAVE)
@pytest.mark.parametrize(("sms", "kv_heads", "requests"), FEW)
def test_few_programs_fill_a_wave(
    gd: Any, monkeypatch: pytest.MonkeyPatch, sms: int, kv_heads: int, requests: int
) -> None:
    """With fewer programs the registers stage 1's grid is one wave of the
    programs the register cap leaves resident, full but for less than one
    split's programs."""
    monkeypatch.setattr(gd, "_num_sms", lambda device: sms)
    s = splits(gd, requests, kv_heads)
    programs, wave = requests * kv_heads, RESIDENT * sms
    if not 0 <= wave - programs * s < programs:
        raise AssertionError(
            f"{s} splits for {requests} requests x {kv_heads} KV heads on {sms} "
            f"SMs fill {programs * s} of the {wave} program slots of one wave "
            f"of the {RESIDENT} programs a SM the register cap leaves"
        )


@tb.env_cases(REGS)
def test_few_programs_take_the_capped_launch(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fewer programs the step launches the registers stage 1 as with
    many: under the register cap, 32 tokens a step where they fit one warp
    (``_regs_one_warp_wide``), else 16."""
    width = 16 if env.shape.preset == "turboquant_3bit_nc" else 32
    got = stage1_config(env, monkeypatch, many=False)
    assert got == ("regs_stage1", width, 1, True), f"launch: {got}"


@tb.env_cases(REGS[:1])
def test_stage2_merges_a_wave_in_few_steps(
    env: tb.Backend, gd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 2 merges the splits of one request on an H100 (132 SMs, 4 KV
    heads: one wave of 396 splits) in at most 8 steps."""
    (stage2,) = [c for c in step_launches(env, monkeypatch) if "stage2" in c["kernel"]]
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    steps = math.ceil(splits(gd, 1, 4) / stage2["kwargs"]["BLOCK_S"])
    assert steps <= 8, f"stage 2 merges one request's splits in {steps} steps"


@tb.env_cases([("turboquant_4bit_nc", FP16)])
def test_fp16_mse_keys_launch(
    env: tb.Backend, gd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 queries on MSE keys (the centroids' low parts) with fewer
    programs keep the uncapped launch of 16 tokens and 8 programs a SM
    where the backend does not put them in the registers stage 1 at every
    batch (from tq-v0.33/0023 it does: the capped launch)."""
    regs = env.impl()._grouped_in_registers
    got = stage1_config(env, monkeypatch, many=False)
    assert got == ("regs_stage1", 16, 1, regs), f"launch: {got}"
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    assert regs or splits(gd, 8, 4, regs) == math.ceil(8 * 132 / 32)


@tb.env_cases(REGS)
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode with fewer programs (Triton's
    interpreter) against float64 attention over the K/V the cache holds:
    its largest error at most 1.25x v0.33.0's kernel's on the same cache
    (the decode accuracy suite's bound)."""
    tb.check_regs_step(env)
