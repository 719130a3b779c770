"""32 tokens a step on one warp where they fit the register cap (tq-v0.33/0019).

With many (request, KV head) programs the registers stage 1 runs under a
register cap of 168, 16 tokens a step on one warp (0010's choice, from a
sweep where every launch sat at 254-255 registers and 32 tokens saved 6-9 %
of the instructions). 0013-0018 made the token loop lean, so what a step
costs apart from its tokens (block ids, the softmax's maxima and sums, the
rescale of both accumulators) is a larger share: at head sizes up to 128
with at most 8 query heads a KV head, 32 tokens a step on one warp take
0.67-0.89x the warp instructions a token and fit the cap without spills
(ptxas for sm_90; ci/gpu/NOTES.md). The patch takes them there; fp16
queries (the centroids' low parts) and 3-bit keys with 3-bit values at
head size 64 only, where 128 spills.

The regression test records the stage-1 launch the backend makes for a
decode step with many programs (not run, as CUDA would launch it); the
others check which launches keep 16 tokens, that the 32-token launch
compiled for sm_90 under the cap spills nothing, and run the step's
decode in Triton's interpreter against float64 attention over the K/V the
cache holds, beside v0.33.0's kernel.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import tqbatches as tb
from tqptx import compile_spec, compile_stage1, stage1_config, stage1_launch

SIXTEEN = r"^turboquant_\w+ with \w+ queries runs 16 tokens a step on one warp"
BF16, FP16 = torch.bfloat16, torch.float16
WIDE = [("turboquant_4bit_nc", BF16), ("turboquant_k8v4", BF16),
        ("turboquant_k3v4_nc", BF16)]  # fmt: skip
NARROW = [("turboquant_3bit_nc", BF16), ("turboquant_4bit_nc", FP16)]

# The tree's backend at head size 128 with 4 query heads a KV head.
env = tb.cases_fixture("t32", hq=8, hk=2, head=128)


@pytest.mark.bug_signature(AssertionError, SIXTEEN)
@tb.env_cases(WIDE)
def test_32_tokens_on_one_warp(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many programs the step launches the registers stage 1 with 32
    tokens on one warp, under the register cap."""
    got = stage1_config(env, monkeypatch, many=True)
    if got[1:3] == (16, 1):
        raise AssertionError(
            f"{env.shape.preset} with {str(env.shape.dtype)[6:]} queries runs "
            "16 tokens a step on one warp at head size 128 with many programs, "
            "where 32 fit the register cap"
        )
    assert got == ("regs_stage1", 32, 1, True), f"launch: {got}"


@tb.env_cases(NARROW)
def test_16_tokens_where_32_spill(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3-bit keys with 3-bit values and fp16 queries keep 16 tokens at head
    size 128 (32 spill under the cap)."""
    assert stage1_config(env, monkeypatch, many=True) == ("regs_stage1", 16, 1, True)


@tb.env_cases(WIDE[:1])
def test_few_programs_launch(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer programs than ``_many_programs`` the launch is 16 tokens on
    one warp, uncapped; from tq-v0.33/0022 (``_REGS_FEW_WAVES``) the launch
    of many (its split count: test_tq_few_programs.py)."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    want = ("regs_stage1", 16, 1, False)
    if hasattr(gd, "_REGS_FEW_WAVES"):
        want = stage1_config(env, monkeypatch, many=True)
    got = stage1_config(env, monkeypatch, many=False)
    assert got == want, f"launch: {got}"


@pytest.mark.cpu_only  # compiles for sm_90 without a GPU (as 0013's test)
@tb.env_cases(WIDE)
def test_32_tokens_spill_nothing(
    env: tb.Backend, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 32-token launch compiled for sm_90 under the register cap: no
    local-memory loads or stores (spills) in its SASS."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    monkeypatch.setattr(gd, "_num_sms", lambda device: 2)
    call = stage1_launch(env, monkeypatch)
    sass = compile_stage1(compile_spec(call, "sass", aligned=True), vllm_tree)
    spills = re.findall(r"\b(?:LDL|STL)\b", sass)
    assert not spills, f"{len(spills)} spill instructions under the cap"


@tb.env_cases(WIDE[:2])
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode with many programs (Triton's
    interpreter) against float64 attention over the K/V the cache holds:
    its largest error at most 1.25x v0.33.0's kernel's on the same cache
    (the decode accuracy suite's bound)."""
    tb.check_regs_step(env, many=True)
