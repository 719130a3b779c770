# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant continuation prefill after the workspace is locked.

The runner locks the workspace manager after its warm-up; every later
request must fit what the attention metadata builder reserved. Without
chunked prefill a continuation still comes (a prefix-cache hit, a
KV-connector hit, a resumed request), and its cached context used to be
dequantized into a workspace buffer sized by the context length, which
the builder had not reserved (vllm#41726).
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
from vllm.v1.worker import workspace

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 128, 16
# Longer than the continuation threshold, so the chunk is not run as
# per-token decodes but attends to its dequantized context.
CACHED_LEN, CHUNK_LEN = 64, 136
MAX_MODEL_LEN = 32768


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=1,
            max_num_batched_tokens=MAX_MODEL_LEN,
            enable_chunked_prefill=False,
        ),
        model_config=SimpleNamespace(
            max_model_len=MAX_MODEL_LEN,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: NUM_HEADS,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        kv_transfer_config=None,
    )


def _metadata(builder, cached_len: int, q_len: int, device) -> object:
    seq_len = cached_len + q_len
    positions = torch.arange(cached_len, seq_len, device=device)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=1,
        num_actual_tokens=q_len,
        max_query_len=q_len,
        max_seq_len=seq_len,
        block_table_tensor=torch.arange(
            math.ceil(MAX_MODEL_LEN / BLOCK_SIZE), dtype=torch.int32, device=device
        )[None],
        slot_mapping=positions.long(),
        causal=True,
    )
    return builder.build(common_prefix_len=0, common_attn_metadata=cam)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton not available on this platform")
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_continuation_prefill_after_workspace_lock(monkeypatch, preset):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config()
    monkeypatch.setattr(turboquant_attn, "get_current_vllm_config", lambda: vllm_config)
    workspace.init_workspace_manager(device)
    try:
        impl = turboquant_attn.TurboQuantAttentionImpl(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            kv_cache_dtype=preset,
        )
        spec = turboquant_attn.TurboQuantAttentionBackend.customize_spec(
            FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.uint8,
                kv_quant_mode=get_kv_quant_mode(preset),
            )
        )
        builder = turboquant_attn.TurboQuantMetadataBuilder(
            kv_cache_spec=spec,
            layer_names=["layers.0.self_attn.attn"],
            vllm_config=vllm_config,
            device=device,
        )
        layer = torch.nn.Module()
        num_blocks = math.ceil((CACHED_LEN + CHUNK_LEN) / BLOCK_SIZE)
        # The runner's layout (blocks, tokens, heads, slot), as the backend
        # receives it.
        kv_cache = torch.zeros(
            num_blocks,
            BLOCK_SIZE,
            NUM_KV_HEADS,
            impl.tq_config.slot_size_aligned,
            dtype=torch.uint8,
            device=device,
        ).transpose(1, 2)
        gen = torch.Generator().manual_seed(0)
        seq_len = CACHED_LEN + CHUNK_LEN
        q = torch.randn(CHUNK_LEN, NUM_HEADS, HEAD_SIZE, generator=gen)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        q, k, v = (x.to(device, torch.float16) for x in (q, k, v))

        # The context's K/V, stored when its own prefill ran.
        impl.do_kv_cache_update(
            layer,
            k[:CACHED_LEN],
            v[:CACHED_LEN],
            kv_cache,
            torch.arange(CACHED_LEN, device=device),
        )
        workspace.lock_workspace()

        metadata = _metadata(builder, CACHED_LEN, CHUNK_LEN, device)
        impl.do_kv_cache_update(
            layer, k[CACHED_LEN:], v[CACHED_LEN:], kv_cache, metadata.slot_mapping
        )
        out = impl.forward(
            layer, q, k[CACHED_LEN:], v[CACHED_LEN:], kv_cache, metadata
        ).view(CHUNK_LEN, NUM_HEADS, HEAD_SIZE)
    finally:
        workspace.reset_workspace_manager()

    # Against attention over the unquantized K/V: only the cache's
    # quantization error is left (a chunk that misses its context, or half
    # of it, is below 0.4 here).
    group = NUM_HEADS // NUM_KV_HEADS
    mask = torch.ones(CHUNK_LEN, seq_len, dtype=torch.bool).tril(CACHED_LEN)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask.to(device),
        scale=HEAD_SIZE**-0.5,
    ).transpose(0, 1)
    cos = F.cosine_similarity(out.float(), ref, dim=-1)
    assert cos.min() > 0.95, f"min cosine to the reference: {cos.min():.4f}"
