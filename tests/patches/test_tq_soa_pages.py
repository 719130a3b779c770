"""TurboQuant pages for the grouped decode in turboquant_soa's layout
(tq-v0.33/0011).

v0.33.0's CUDA store writes each (token, KV head) as one slot record: key
codes, norm, value codes, scale, zero, 70 bytes at D 64 and 262 at D 256,
so a token's code rows start 2-byte aligned and the grouped decode loads
them two bytes at a time and repacks them (a third of 0010's 4-bit loop on
an H200). v0.33.0 already has a layout with aligned rows, its
turboquant_soa store (FlyDSL's, on ROCm): per page the code rows [block, Hk,
key codes + value codes], then the fp16 fields as [Hk, field, block]
arrays. The patch stores that layout where the grouped decode reads it
faster (4-bit values with FP8 or 4-bit keys: turboquant_4bit_nc, k8v4),
with the norms raw (the decode corrects them at load, as on slots).

The regression test reads a page the backend stored back through both
layouts' offsets (``tqharness.record_offsets``): on the base it holds
slots. The others hold the patched tree to the same values: the pages
hold the slot store's bytes rearranged (raw norms, not folded),
turboquant_3bit_nc keeps slots, the grouped decode gives the same bits
on SoA pages as on slots (both stage-1 kernels, every preset, both query
dtypes), and the continuation's dequantization of them the same tiles. Where a batch
has many programs at head size 256 the SoA decode takes wider steps (and
fp16 queries the registers stage 1): its output within twice the
rounding of the slots'. The backend's batches over these pages are checked
against float64 by test_tq_batches.py and test_tq_grouped_decode.py
(the harness reads either layout).

Small shapes: on CPU every Triton kernel runs in the interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import tqbatches as tb
import tqharness as h

PRESETS = {
    "4bit_nc": "turboquant_4bit_nc",
    "k8v4": "turboquant_k8v4",
    "3bit_nc": "turboquant_3bit_nc",
    "k3v4_nc": "turboquant_k3v4_nc",
}
SLOTS = r"^the grouped decode's KV pages hold slots"
SOA_PRESETS = ["4bit_nc", "k8v4"]  # where the backend stores SoA pages
REQS = [tb.Req(40, 1), tb.Req(23, 1)]


@pytest.fixture(scope="module", params=list(PRESETS))
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a GQA model the grouped decode takes (Hq 4,
    Hk 2, D 64)."""
    shape = tb.Shape(hq=4, hk=2, head=64, preset=PRESETS[request.param])
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"soa_{request.param}"
    )


@pytest.mark.bug_signature(AssertionError, SLOTS)
@pytest.mark.parametrize("env", SOA_PRESETS, indirect=True)
def test_grouped_decode_pages_are_soa_rows(env: tb.Backend) -> None:
    """The backend's pages, read through turboquant_soa's offsets, hold the
    slot store's records (raw norms): each token's codes one row of key
    and value codes, the fp16 fields in arrays after the page's rows."""
    impl, _, batch, slots = tb.slot_twin(env, REQS)
    cfg = impl.tq_config
    layout = tb.page_layout(batch, slots, cfg, REQS)
    if layout == "slots":
        raise AssertionError(
            f"the grouped decode's KV pages hold slots ({cfg.slot_size}-byte "
            "records a token and head), not turboquant_soa's code rows and "
            "fp16 field arrays"
        )
    assert layout == "soa", "the backend's pages hold neither layout's records"


@pytest.mark.parametrize("env", ["3bit_nc"], indirect=True)
def test_three_bit_values_keep_slots(env: tb.Backend) -> None:
    """turboquant_3bit_nc, where the grouped decode was slower on SoA pages
    (0009's byte loads of 3-bit groups; since 0014 its codes load as words
    either way), stays in slots. (k3v4_nc: from tq-v0.33/0017 on SoA pages,
    test_tq_k3v4_soa.py.)"""
    impl, _, batch, slots = tb.slot_twin(env, REQS)
    assert tb.page_layout(batch, slots, impl.tq_config, REQS) == "slots"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_soa_decode_matches_slot_decode(env: tb.Backend, dtype: torch.dtype) -> None:
    """The grouped decode over SoA pages (the slot store's records moved,
    ``h.as_soa``) gives the bits it gives over the slots, at 1 and 2
    splits: both stage-1 kernels, every preset."""
    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        triton_turboquant_grouped_decode_attention as grouped,
    )

    impl, layer, batch, slots = tb.slot_twin(env, REQS)
    pages = h.as_soa(slots, impl.tq_config)
    s = env.shape
    q = torch.randn(len(REQS), s.hq, s.head, generator=torch.Generator().manual_seed(3))
    args = {
        "query": q.to(dtype).to(tb.DEVICE),
        "block_table": batch.cam.block_table_tensor,
        "seq_lens": torch.tensor([r.cached for r in REQS], dtype=torch.int32).to(
            tb.DEVICE
        ),
        **h.decode_params(layer, impl),
    }
    for splits in (1, 2):
        on_slots = grouped(kv_cache=slots, num_kv_splits=splits, **args)
        on_soa = grouped(kv_cache=pages, num_kv_splits=splits, soa_layout=True, **args)
        assert torch.equal(on_soa, on_slots), (
            f"{splits} splits: max |soa - slots| = "
            f"{(on_soa.float() - on_slots.float()).abs().max().item():.3g}"
        )


def test_continuation_dequant_of_soa_pages(env: tb.Backend) -> None:
    """The continuation's tiles (``_dequant_tile``) from SoA pages, the
    norms corrected at load, equal those from the slots."""
    impl, layer, batch, slots = tb.slot_twin(env, REQS)
    s, n = env.shape, REQS[0].cached
    table = batch.cam.block_table_tensor[:1]
    tiles = []
    for cache, soa in ((h.as_soa(slots, impl.tq_config), True), (slots, False)):
        impl._soa_store = soa
        k = torch.zeros(n, s.hk, s.head, dtype=torch.float16, device=tb.DEVICE)
        v = torch.zeros_like(k)
        impl._dequant_tile(cache, table, layer._tq_centroids, k, v)
        tiles.append((k, v))
    (k_soa, v_soa), (k_slots, v_slots) = tiles
    assert torch.equal(k_soa, k_slots), "keys differ"
    assert torch.equal(v_soa, v_slots), "values differ"


@pytest.mark.parametrize(
    "preset,dtype,group",
    [
        ("turboquant_4bit_nc", torch.bfloat16, 4),  # 32 tokens on two warps
        ("turboquant_4bit_nc", torch.float16, 4),  # registers stage 1, low parts
        ("turboquant_k8v4", torch.bfloat16, 16),  # FP8 keys, 32 on two warps
    ],
)
def test_soa_decode_at_many_programs(
    vllm_tree: Path, cpu_platform: Any, preset: str, dtype: torch.dtype, group: int
) -> None:
    """Where a batch has at least ``_many_programs`` (8 requests x 2 KV
    heads on CPU's 32 SMs) at head size 256, the decode on SoA pages takes
    other steps than on slots (32 tokens on two warps; fp16 queries on the
    registers stage 1): the same output to within twice its rounding."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    from vllm.v1.attention.ops import triton_turboquant_grouped_decode as gd
    from vllm.v1.attention.ops.triton_turboquant_store import (
        triton_turboquant_store,
    )

    d, hk, block, batch = 256, 2, 16, 8
    assert gd._many_programs(batch, hk, torch.device(tb.DEVICE.type)) or tb.HAS_CUDA
    cfg = h.tq_config(preset, d)
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 120, (batch,), generator=g, dtype=torch.int32)
    pages = -(-int(lens.max()) // block)
    k, v = torch.randn(2, batch * pages * block, hk, d, generator=g).to(dtype)
    cen = get_centroids(d, cfg.centroid_bits).float()
    mids = (cen.sort()[0][1:] + cen.sort()[0][:-1]) / 2
    pit = _build_hadamard(d, str(tb.DEVICE))
    slots = torch.zeros(
        batch * pages, block, hk, cfg.slot_size_aligned, dtype=torch.uint8
    )
    slots = slots.to(tb.DEVICE)
    triton_turboquant_store(
        k.to(tb.DEVICE), v.to(tb.DEVICE), slots,
        torch.arange(k.shape[0], dtype=torch.int32, device=tb.DEVICE),
        pit, mids.to(tb.DEVICE), mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
    )  # fmt: skip
    args = {
        "query": torch.randn(batch, hk * group, d, generator=g).to(dtype).to(tb.DEVICE),
        "block_table": torch.arange(batch * pages, dtype=torch.int32)
        .view(batch, pages)
        .to(tb.DEVICE),
        "seq_lens": lens.to(tb.DEVICE),
        "centroids": cen.to(tb.DEVICE),
        "scale": d**-0.5,
        "mse_bits": cfg.key_mse_bits,
        "key_packed_size": cfg.key_packed_size,
        "value_quant_bits": cfg.effective_value_quant_bits,
        "num_kv_splits": 2,
        "key_fp8": cfg.key_fp8,
        "norm_correction": cfg.norm_correction,
        "PiT": pit,
    }
    on_slots = gd.triton_turboquant_grouped_decode_attention(kv_cache=slots, **args)
    on_soa = gd.triton_turboquant_grouped_decode_attention(
        kv_cache=h.as_soa(slots, cfg), soa_layout=True, **args
    )
    err = (on_soa.float() - on_slots.float()).abs().max().item()
    assert err <= 2 * tb.half_ulp(dtype, on_slots), f"max |soa - slots| = {err:.3g}"
