"""3-bit codes on the grouped decode's registers stage 1 (tq-v0.33/0012).

0010's registers stage 1 dequantizes 4-bit codes where the MMA takes them
(a PTX table of the centroids, values by their bits); 3-bit keys
(turboquant_3bit_nc, k3v4_nc) kept 0009's first stage 1, which gathers each
code's centroid from memory and splits it into fp16 high and low parts: on
an H200 those presets ran at 16-23x their compressed floor and 2.7-5.3x
bf16 FA2's time, 2x the 4-bit presets' time for fewer bytes. The patch
takes their codes (``_codes``: a group of eight in three bytes) and 3-bit
values into the registers stage 1.

The regression test records which stage 1 the backend's decode step
launches for a 3-bit preset: on the base, the first. The others hold the
step to float64 attention over the K/V the cache holds, with both query
dtypes (fp16: the centroids' low parts), and keep the first stage 1 where
the registers one's accumulators do not fit (head size 512; 256 with 16
query heads a KV head until 0015). test_tq_batches.py,
test_tq_grouped_decode.py and test_tq_differential.py run these presets
through the backend against float64 too.

Small shapes: on CPU every Triton kernel runs in the interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import tqbatches as tb

FIRST = r"^3-bit keys run the first stage 1"
PRESETS = {"3bit_nc": "turboquant_3bit_nc", "k3v4_nc": "turboquant_k3v4_nc"}


@pytest.fixture(scope="module", params=[(p, d) for p in PRESETS
                                        for d in (torch.bfloat16, torch.float16)],
                ids=lambda x: f"{x[0]}-{str(x[1])[6:]}")  # fmt: skip
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a GQA model the grouped decode takes (Hq 4,
    Hk 2, D 64) with a 3-bit preset and the query dtype."""
    preset, dtype = request.param
    shape = tb.Shape(hq=4, hk=2, head=64, preset=PRESETS[preset], dtype=dtype)
    name = f"regs3_{preset}_{str(dtype)[6:]}"
    yield from tb.backend_fixture(vllm_tree, tmp_path_factory, shape, name)


@pytest.mark.bug_signature(AssertionError, FIRST)
def test_three_bit_codes_on_registers_stage1(env: tb.Backend) -> None:
    """The decode step of a 3-bit preset launches the registers stage 1."""
    log, _, _ = tb.decode_step(env)
    if log == ["first"]:
        raise AssertionError(
            "3-bit keys run the first stage 1 (each code's centroid gathered "
            "from memory and split into fp16 high and low parts), not the "
            "registers stage 1"
        )
    assert log == ["regs"], f"stage-1 launches: {log}"


def test_three_bit_step_matches_reference(env: tb.Backend) -> None:
    """Its output within the output dtype's rounding of float64 attention
    over the K/V the cache holds (two roundings: the kernel's fp32 sums)."""
    _, got, want = tb.decode_step(env)
    err = (got - want).abs().max().item()
    assert err <= 2 * tb.half_ulp(env.shape.dtype, want), f"max |error| = {err:.3g}"


def test_first_stage1_where_accumulators_do_not_fit() -> None:
    """Where the registers stage 1's accumulators fit no warp of it (head
    size 512: two [256, 8] fp32 accumulators a warp) 3-bit keys keep the
    first stage 1; 4-bit keys do not. (0012 kept the first at head size
    256 with 16 query heads a KV head too; 0015 takes that shape to two
    warps, test_tq_two_warps.py.)"""
    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        grouped_decode_in_registers as regs,
    )

    bf16 = torch.bfloat16
    assert regs(False, 3, 3, bf16, 128, 16) and regs(False, 3, 4, bf16, 256, 8)
    assert not regs(False, 3, 3, bf16, 512, 8)
    assert not regs(False, 3, 4, bf16, 512, 4)
    assert regs(False, 4, 4, bf16, 512, 8)
    assert not regs(False, 3, 3, torch.float16, 256, 4)  # small batches only
