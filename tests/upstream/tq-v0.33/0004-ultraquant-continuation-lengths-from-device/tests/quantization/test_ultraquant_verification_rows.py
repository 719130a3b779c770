# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""UltraQuant speculative-decoding verification rows (q_len = 1 + k) under
full CUDA graphs and async scheduling.

Verification batches run through the prefill loop, which chose its branch
and causal lengths from the host copies of seq_lens:

- A full graph replays what capture recorded. The runner captures with
  seq_len == q_len; the loop then recorded the first-chunk branch, which
  ignores the cache, for every replayed verification batch.
- With async scheduling the host seq_lens are an upper bound (every draft
  of the previous step accepted); after a rejection each query saw
  positions past its own.

Both are checked against the same batch run eagerly with exact lengths
(UltraQuant's small continuation is its own loop, not TurboQuant's).
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn, ultraquant_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 128, 16
NUM_DRAFTS = 3
PRESET = "ultraquant_4bit"
CONTEXT_LENS = [40, 57]  # cached tokens before each request's rows
MAX_BLOCKS = 8


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=len(CONTEXT_LENS),
            max_num_batched_tokens=2048,
            enable_chunked_prefill=True,
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


def _common_metadata(seq_lens: list[int], host_seq_lens: list[int], device):
    q_len = 1 + NUM_DRAFTS
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32) * q_len
    slots = [
        block * MAX_BLOCKS * BLOCK_SIZE + pos
        for block, seq_len in enumerate(seq_lens)
        for pos in range(seq_len - q_len, seq_len)
    ]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu_upper_bound=torch.tensor(host_seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=len(seq_lens) * q_len,
        max_query_len=q_len,
        max_seq_len=max(host_seq_lens),
        block_table_tensor=torch.arange(
            len(seq_lens) * MAX_BLOCKS, dtype=torch.int32, device=device
        ).view(len(seq_lens), MAX_BLOCKS),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        causal=True,
    )


def _reference(q: torch.Tensor, kv: list[torch.Tensor], q_len: int) -> torch.Tensor:
    """Float attention of each request's rows over its unquantized K/V, row t
    seeing its context and the rows up to its own."""
    out = []
    for i, (k_i, v_i) in enumerate(kv):
        context = k_i.shape[0] - q_len
        k_i, v_i = (
            x.float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
            for x in (k_i, v_i)
        )
        for t in range(q_len):
            scores = torch.einsum(
                "hd,khd->hk", q[i * q_len + t].float(), k_i[: context + t + 1]
            )
            probs = (scores * HEAD_SIZE**-0.5).softmax(-1)
            out.append(torch.einsum("hk,khd->hd", probs, v_i[: context + t + 1]))
    return torch.stack(out)


@pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()),
    reason="UltraQuant's bf16 kernels need a GPU",
)
@pytest.mark.parametrize("mode", ["graph_replay", "async_upper_bound"])
def test_verification_rows_read_their_lengths_from_device(monkeypatch, mode):
    device = torch.device("cuda")
    vllm_config = _vllm_config()
    for module in (turboquant_attn, ultraquant_attn):
        monkeypatch.setattr(module, "get_current_vllm_config", lambda: vllm_config)
    impl = ultraquant_attn.UltraQuantAttentionImpl(
        num_heads=NUM_HEADS,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        kv_cache_dtype=PRESET,
    )
    spec = ultraquant_attn.UltraQuantAttentionBackend.customize_spec(
        FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.uint8,
            kv_quant_mode=get_kv_quant_mode(PRESET),
        )
    )
    builder = turboquant_attn.TurboQuantMetadataBuilder(
        spec, ["layers.0.self_attn.attn"], vllm_config, device
    )
    layer = torch.nn.Module()
    kv_cache = torch.zeros(
        len(CONTEXT_LENS) * MAX_BLOCKS,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        spec.state_content_bytes,
        dtype=torch.uint8,
        device=device,
    ).transpose(1, 2)
    q_len = 1 + NUM_DRAFTS
    seq_lens = [c + q_len for c in CONTEXT_LENS]
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(2, s, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(
            device, torch.bfloat16
        )
        for s in seq_lens
    ]
    # Every request's K/V up to and including its verification rows, stored
    # before the forward as the runner does.
    for i, (k_i, v_i) in enumerate(kv):
        slots = torch.arange(seq_lens[i], device=device) + i * MAX_BLOCKS * BLOCK_SIZE
        impl.do_kv_cache_update(layer, k_i, v_i, kv_cache, slots)
    q = torch.randn(len(seq_lens) * q_len, NUM_HEADS, HEAD_SIZE, generator=gen)
    q = q.to(device, torch.bfloat16)
    k = torch.cat([k_i[-q_len:] for k_i, _ in kv])
    v = torch.cat([v_i[-q_len:] for _, v_i in kv])

    def forward(metadata):
        return impl.forward(layer, q, k, v, kv_cache, metadata).clone()

    eager = forward(builder.build(0, _common_metadata(seq_lens, seq_lens, device)))
    cos = torch.nn.functional.cosine_similarity(
        eager.view(q.shape).float(), _reference(q, kv, q_len), dim=-1
    )
    assert cos.min() > 0.95, f"eager: min cosine to the reference {cos.min():.3f}"
    if mode == "graph_replay":
        # Capture as the runner does (seq_len == q_len on host and device),
        # then a replay: the step's lengths written into the device buffer,
        # the host values as they were at capture.
        q_lens = [q_len] * len(seq_lens)
        metadata = builder.build_for_cudagraph_capture(
            _common_metadata(q_lens, q_lens, device)
        )
        metadata.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
    else:
        # Async scheduling: the host assumes all drafts of the last step
        # were accepted; the device has the exact lengths.
        host = [s + NUM_DRAFTS for s in seq_lens]
        metadata = builder.build(0, _common_metadata(seq_lens, host, device))
    got = forward(metadata)
    err = (got.float() - eager.float()).abs().max().item()
    assert err < 1e-3, f"{mode}: max difference to the eager batch {err:.3f}"
