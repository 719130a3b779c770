# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""UltraQuant prefill of a prefix-cache hit batched with a longer fresh prompt.

With flash-attn, the prefill sent the whole batch to one varlen call over the
batch's own K/V when max_query_len == max_seq_len, read as "no request has
cached context". A fresh 48-token prompt and a hit of 32 cached + 16 new
tokens have both maxima 48, and the hit attended to its 16 new tokens only
(vllm#46460, TurboQuant's bug in UltraQuant's own prefill). Where flash-attn
is not installed, a float stand-in with its varlen signature takes its place.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn, ultraquant_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 128, 16
MAX_BLOCKS = 4
FRESH, HIT = (0, 48), (32, 16)  # (cached tokens, new tokens)


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=2, max_num_batched_tokens=2048, enable_chunked_prefill=True
        ),
        model_config=SimpleNamespace(
            max_model_len=MAX_BLOCKS * BLOCK_SIZE,
            dtype=torch.bfloat16,
            get_num_attention_heads=lambda parallel_config: NUM_HEADS,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        kv_transfer_config=None,
    )


def _varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, **kwargs
):
    """flash_attn_varlen_func in float: bottom-right causal, GQA."""
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (
            x[cu[b] : cu[b + 1]].transpose(0, 1).float()
            for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))
        )
        mask = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool)
        mask = mask.tril(ks.shape[1] - qs.shape[1]).to(q.device)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=softmax_scale, enable_gqa=True
        )
        out[cu_q[b] : cu_q[b + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def _metadata(builder, reqs: list[tuple[int, int]], device):
    q_lens = [new for _, new in reqs]
    seq_lens = [cached + new for cached, new in reqs]
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0)
    slots = [
        i * MAX_BLOCKS * BLOCK_SIZE + pos
        for i, (cached, new) in enumerate(reqs)
        for pos in range(cached, cached + new)
    ]
    cam = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        query_start_loc_cpu=query_start_loc.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(reqs),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(
            len(reqs) * MAX_BLOCKS, dtype=torch.int32, device=device
        ).view(len(reqs), MAX_BLOCKS),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        causal=True,
    )
    return builder.build(common_prefix_len=0, common_attn_metadata=cam)


@pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()),
    reason="UltraQuant's bf16 kernels need a GPU",
)
@pytest.mark.parametrize("order", ["fresh_first", "hit_first"])
def test_prefix_hit_batched_with_longer_fresh_prompt(monkeypatch, order):
    device = torch.device("cuda")
    vllm_config = _vllm_config()
    for module in (turboquant_attn, ultraquant_attn):
        monkeypatch.setattr(module, "get_current_vllm_config", lambda: vllm_config)
    if not ultraquant_attn._HAS_FLASH_ATTN:
        monkeypatch.setattr(ultraquant_attn, "_HAS_FLASH_ATTN", True)
        monkeypatch.setattr(
            turboquant_attn, "flash_attn_varlen_func", _varlen_attention, raising=False
        )
    preset = "ultraquant_4bit"
    impl = ultraquant_attn.UltraQuantAttentionImpl(
        num_heads=NUM_HEADS,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        kv_cache_dtype=preset,
    )
    spec = ultraquant_attn.UltraQuantAttentionBackend.customize_spec(
        FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.uint8,
            kv_quant_mode=get_kv_quant_mode(preset),
        )
    )
    builder = turboquant_attn.TurboQuantMetadataBuilder(
        spec, ["layers.0.self_attn.attn"], vllm_config, device
    )
    layer = torch.nn.Module()
    reqs = [FRESH, HIT] if order == "fresh_first" else [HIT, FRESH]
    kv_cache = torch.zeros(
        len(reqs) * MAX_BLOCKS,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        spec.state_content_bytes,
        dtype=torch.uint8,
        device=device,
    ).transpose(1, 2)
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randn(new, NUM_HEADS, HEAD_SIZE, generator=gen) for _, new in reqs]
    kv = [
        torch.randn(2, cached + new, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        for cached, new in reqs
    ]
    qs = [x.to(device, torch.bfloat16) for x in qs]
    kv = [x.to(device, torch.bfloat16) for x in kv]
    # The hit's cached tokens, stored by an earlier step.
    for i, ((cached, _), (k_i, v_i)) in enumerate(zip(reqs, kv)):
        slots = torch.arange(cached, device=device) + i * MAX_BLOCKS * BLOCK_SIZE
        impl.do_kv_cache_update(layer, k_i[:cached], v_i[:cached], kv_cache, slots)
    q = torch.cat(qs)
    k, v = (torch.cat([x[j][c:] for (c, _), x in zip(reqs, kv)]) for j in range(2))
    metadata = _metadata(builder, reqs, device)
    impl.do_kv_cache_update(layer, k, v, kv_cache, metadata.slot_mapping)
    out = impl.forward(layer, q, k, v, kv_cache, metadata).view(q.shape)

    # Each request against float attention over its whole unquantized K/V:
    # only the cache's quantization error is left.
    start = 0
    for (cached, new), q_i, (k_i, v_i) in zip(reqs, qs, kv):
        ref = _varlen_attention(
            q_i,
            k_i,
            v_i,
            torch.tensor([0, new]),
            torch.tensor([0, cached + new]),
            HEAD_SIZE**-0.5,
            causal=True,
        )
        cos = F.cosine_similarity(out[start : start + new].float(), ref.float(), -1)
        assert cos.min() > 0.95, (
            f"request of {cached} cached + {new} new tokens in {reqs}: "
            f"min cosine to the reference {cos.min():.3f}"
        )
        start += new
