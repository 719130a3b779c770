# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant keeps slot pages where a KV connector moves them.

On CUDA the grouped decode's layers store turboquant_soa's pages for 4-bit
values, which a process whose store writes slots decodes wrongly. A KV
connector hands pages to such processes (disaggregated prefill and decode,
shared offloading tiers), so with one configured the layers store slots;
without one, turboquant_soa's pages.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import KVTransferConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 16
NUM_TOKENS, NUM_BLOCKS = 40, 4


def _vllm_config(role: str | None):
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
        kv_transfer_config=None
        if role is None
        else KVTransferConfig(kv_connector="ExampleConnector", kv_role=role),
    )


@pytest.mark.parametrize("role", [None, "kv_producer", "kv_consumer", "kv_both"])
@pytest.mark.parametrize(
    "preset", ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_k3v4_nc"]
)
def test_slot_pages_with_a_kv_connector(monkeypatch, preset, role):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config(role)
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
    cache = torch.zeros(shape, dtype=torch.uint8, device=device)
    slots = torch.zeros_like(cache)
    impl._store_kv(k, v, cache, slot_mapping, layer)
    triton_turboquant_store(
        k,
        v,
        slots,
        slot_mapping,
        layer._tq_PiT,
        layer._tq_midpoints,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
    )
    if role is None:
        assert not torch.equal(cache, slots), (
            "without a KV connector the layers store slots, not turboquant_soa's pages"
        )
    else:
        assert torch.equal(cache, slots), (
            f"with a KV connector ({role}) the layers store pages a peer storing "
            "slots cannot read"
        )
