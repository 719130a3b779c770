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
the registers one's accumulators do not fit (head size 256 with 16 query
heads a KV head). test_tq_batches.py, test_tq_grouped_decode.py and
test_tq_differential.py run these presets through the backend against
float64 too.

Small shapes: on CPU every Triton kernel runs in the interpreter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class _Recorded:
    """A Triton kernel whose launches (``kernel[grid]``) are logged by name."""

    def __init__(self, kernel: Any, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: tuple) -> Any:
        self.log.append(self.name)
        return self.kernel[grid]


@contextlib.contextmanager
def stage1_launches() -> Iterator[list[str]]:
    """The grouped decode's stage-1 launches while open: "first", "regs"."""
    from vllm.v1.attention.ops import triton_turboquant_grouped_decode as gd

    log: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for attr, name in (("_tq_grouped_decode_stage1", "first"),
                           ("_tq_grouped_decode_regs_stage1", "regs")):  # fmt: skip
            mp.setattr(gd, attr, _Recorded(getattr(gd, attr), name, log))
        yield log


def decode_step(env: tb.Backend) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """A decode step of three requests through the backend's forward: the
    stage-1 kernels it launched, its output and the float64 reference."""
    impl, layer, batch = tb.decode_batch(env, [200, 77, 16], seed=12)
    meta = env.builder().build(0, batch.cam)
    with stage1_launches() as log:
        out = tb.forward(impl, layer, batch, meta)
    want = torch.cat(tb.reference(batch, impl, layer))
    return log, tb.plain(out).double().cpu()[: want.shape[0]], want


@pytest.mark.bug_signature(AssertionError, FIRST)
def test_three_bit_codes_on_registers_stage1(env: tb.Backend) -> None:
    """The decode step of a 3-bit preset launches the registers stage 1."""
    log, _, _ = decode_step(env)
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
    _, got, want = decode_step(env)
    err = (got - want).abs().max().item()
    assert err <= 2 * tb.half_ulp(env.shape.dtype, want), f"max |error| = {err:.3g}"


def test_first_stage1_where_accumulators_do_not_fit() -> None:
    """At head size 256 with 16 query heads a KV head (two [128, 16] fp32
    accumulators a warp: 1.2x slower than the first stage 1 on an H200 at
    many programs) 3-bit keys keep the first stage 1; 4-bit keys do not."""
    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        grouped_decode_in_registers as regs,
    )

    bf16 = torch.bfloat16
    assert regs(False, 3, 3, bf16, 128, 16) and regs(False, 3, 4, bf16, 256, 8)
    assert not regs(False, 3, 3, bf16, 256, 16)
    assert not regs(False, 3, 4, bf16, 256, 16)
    assert regs(False, 4, 4, bf16, 256, 16)
    assert not regs(False, 3, 3, torch.float16, 64, 4)  # small batches only
