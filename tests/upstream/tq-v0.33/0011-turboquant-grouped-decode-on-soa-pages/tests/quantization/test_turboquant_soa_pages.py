# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode reads turboquant_soa's pages.

The slot layout puts each (token, KV head) record's codes at 2-byte
aligned offsets, which the grouped decode loads two bytes at a time and
repacks. Where it runs with 4-bit values (turboquant_4bit_nc, k8v4), the
backend now stores turboquant_soa's pages with raw norms: each token's
codes one aligned row, the fp16 fields in arrays. Checked: the backend's
store writes what the SoA store writes with its fold off, and the grouped
decode reads it to the bits it reads from slots holding the same values.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.platforms import current_platform
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.attention.ops.turboquant_soa.triton_turboquant_store import (
    triton_turboquant_store as soa_store,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 16
NUM_TOKENS, NUM_BLOCKS = 40, 4


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=2, max_num_batched_tokens=2048, enable_chunked_prefill=True
        ),
        model_config=SimpleNamespace(
            max_model_len=NUM_BLOCKS * BLOCK_SIZE,
            dtype=torch.bfloat16,
            get_num_attention_heads=lambda parallel_config: NUM_HEADS,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        kv_transfer_config=None,
    )


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_grouped_decode_layers_store_soa_pages(monkeypatch, preset):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config()
    monkeypatch.setattr(turboquant_attn, "get_current_vllm_config", lambda: vllm_config)
    with monkeypatch.context() as m:
        # The grouped decode is taken on CUDA only; a source tree without
        # vLLM's compiled extensions runs under another platform.
        m.setattr(current_platform, "is_cuda", lambda: True)
        impl = turboquant_attn.TurboQuantAttentionImpl(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            kv_cache_dtype=preset,
        )
    layer = torch.nn.Module()
    impl._ensure_on_device(layer, device)
    cfg = impl.tq_config
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(
        device, torch.bfloat16
    )
    slot_mapping = torch.arange(NUM_TOKENS, device=device) + BLOCK_SIZE
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, cfg.slot_size_aligned)
    cache, slots, soa = (
        torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(3)
    )
    impl._store_kv(k, v, cache, slot_mapping, layer)
    packing = {
        "mse_bits": cfg.key_mse_bits,
        "key_packed_size": cfg.key_packed_size,
        "value_quant_bits": cfg.effective_value_quant_bits,
        "key_fp8": cfg.key_fp8,
    }
    triton_turboquant_store(
        k, v, slots, slot_mapping, layer._tq_PiT, layer._tq_midpoints, **packing
    )
    soa_store(
        key=k,
        value=v,
        kv_cache=soa,
        slot_mapping=slot_mapping,
        PiT=layer._tq_PiT,
        midpoints=layer._tq_midpoints,
        centroids=layer._tq_centroids,
        norm_correction=False,
        **packing,
    )
    assert not torch.equal(cache, slots), (
        "the grouped decode's layers store slots, not turboquant_soa's pages"
    )
    assert torch.equal(cache, soa), "the pages differ from the SoA store's (raw norms)"

    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        triton_turboquant_grouped_decode_attention,
    )

    query = torch.randn(2, NUM_HEADS, HEAD_SIZE, generator=gen)
    args = {
        "query": query.to(device, torch.bfloat16),
        "block_table": torch.tensor([[1, 2, 3]] * 2, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([NUM_TOKENS, 23], dtype=torch.int32, device=device),
        "centroids": layer._tq_centroids,
        "scale": impl.scale,
        "num_kv_splits": 2,
        "norm_correction": cfg.norm_correction,
        "PiT": layer._tq_PiT,
        **packing,
    }
    on_soa = triton_turboquant_grouped_decode_attention(
        kv_cache=cache, soa_layout=True, **args
    )
    on_slots = triton_turboquant_grouped_decode_attention(kv_cache=slots, **args)
    assert torch.equal(on_soa, on_slots)
