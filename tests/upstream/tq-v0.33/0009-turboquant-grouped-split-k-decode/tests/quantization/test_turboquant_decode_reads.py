# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode loads each KV head's cache bytes once per query group.

Decode is bound by the cache reads. With GQA the decode kernel ran one
program per query head, so every byte of a KV head was loaded once per query
head of its group; the grouped decode runs one program per KV head and split,
its query heads together on the tensor cores.

The loads are counted in Triton's interpreter, which stands in for the GPU:
the backend is told it runs on CUDA while it is built, as the grouped decode
is taken on CUDA only.
"""

import contextlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 1, 64, 16
CONTEXT_LENS = [200, 77, 16]
MAX_BLOCKS = 16


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=len(CONTEXT_LENS),
            max_num_batched_tokens=2048,
            enable_chunked_prefill=True,
        ),
        model_config=SimpleNamespace(
            max_model_len=MAX_BLOCKS * BLOCK_SIZE,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: NUM_HEADS,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        kv_transfer_config=None,
    )


@contextlib.contextmanager
def _cache_loads(cache: torch.Tensor):
    """Every load from ``cache``'s storage, as (program, byte addresses): a
    program is a launch and its grid index."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    lo = cache.untyped_storage().data_ptr()
    hi = lo + cache.untyped_storage().nbytes()
    loads: list = []
    launches = [0]
    set_grid_dim, masked_load = builder.set_grid_dim, builder.create_masked_load

    def counting_grid_dim(*dims):
        launches[0] += 1
        set_grid_dim(*dims)

    def counting_load(ptrs, mask, *args):
        addrs = np.asarray(ptrs.data).astype(np.int64)
        keep = np.broadcast_to(np.asarray(mask.data), addrs.shape)
        keep = keep & (addrs >= lo) & (addrs < hi)
        if keep.any():
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            every = addrs[keep][:, None] + np.arange(size)[None, :]
            loads.append(((launches[0], *builder.grid_idx), every.ravel()))
        return masked_load(ptrs, mask, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "set_grid_dim", counting_grid_dim)
        mp.setattr(builder, "create_masked_load", counting_load)
        yield loads


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="counts the cache loads in Triton's interpreter (TRITON_INTERPRET=1)",
)
def test_decode_loads_kv_once_per_query_group(monkeypatch):
    device = torch.device("cpu")
    vllm_config = _vllm_config()
    monkeypatch.setattr(turboquant_attn, "get_current_vllm_config", lambda: vllm_config)
    preset = "turboquant_4bit_nc"
    with monkeypatch.context() as m:
        m.setattr(current_platform, "is_cuda", lambda: True)
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
        spec, ["layers.0.self_attn.attn"], vllm_config, device
    )
    layer = torch.nn.Module()
    n = len(CONTEXT_LENS)
    kv_cache = torch.zeros(
        n * MAX_BLOCKS,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        impl.tq_config.slot_size_aligned,
        dtype=torch.uint8,
    ).transpose(1, 2)
    seq_lens = [c + 1 for c in CONTEXT_LENS]
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(2, s, NUM_KV_HEADS, HEAD_SIZE, generator=gen).half()
        for s in seq_lens
    ]
    for i, (k_i, v_i) in enumerate(kv):
        slots = torch.arange(seq_lens[i]) + i * MAX_BLOCKS * BLOCK_SIZE
        impl.do_kv_cache_update(layer, k_i, v_i, kv_cache, slots)
    q = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen).half()
    query_start_loc = torch.arange(n + 1, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(n * MAX_BLOCKS, dtype=torch.int32).view(
            n, MAX_BLOCKS
        ),
        slot_mapping=torch.tensor(
            [i * MAX_BLOCKS * BLOCK_SIZE + s - 1 for i, s in enumerate(seq_lens)]
        ),
        causal=True,
    )
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=cam)
    k, v = (torch.cat([x[j][-1:] for x in kv]) for j in range(2))
    with _cache_loads(kv_cache) as loads:
        out = impl.forward(layer, q, k, v, kv_cache, metadata).view(q.shape)

    for i, (k_i, v_i) in enumerate(kv):
        ref = F.scaled_dot_product_attention(
            q[i, :, None].float(),
            k_i.float().transpose(0, 1),
            v_i.float().transpose(0, 1),
            scale=HEAD_SIZE**-0.5,
            enable_gqa=True,
        )[:, 0]
        cos = F.cosine_similarity(out[i].float(), ref, dim=-1)
        assert cos.min() > 0.95, f"request {i}: min cosine {cos.min():.3f}"
    programs = {p: i for i, p in enumerate(dict.fromkeys(p for p, _ in loads))}
    pid = np.concatenate([np.full(a.size, programs[p]) for p, a in loads])
    addr = np.concatenate([a for _, a in loads])
    readers = np.unique(np.stack([addr, pid]), axis=1)[0]
    most = np.unique(readers, return_counts=True)[1].max()
    assert most == 1, (
        f"each KV head's cache bytes are loaded by {most} programs per decode "
        f"step (Hq {NUM_HEADS}, Hk {NUM_KV_HEADS}), not once per query group"
    )
