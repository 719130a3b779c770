# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode loads 3-bit codes as words.

The registers stage 1 took 3-bit codes as three byte loads a group of eight
and two int32 tiles reshaped from [rows, D / 8, 4]. Now twelve bytes come as
three 32-bit words, each group is spread to nibbles in registers, and the
tile takes the 4-bit codes' path. Checked in the compiled kernel's PTX: its
token loop has fewer single-byte loads than a vector has code bytes.
"""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.jit import JITFunction

from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 1, 128, 16
CONTEXT_LENS = [200, 77]
MAX_BLOCKS = 16
BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
BYTE_LOAD = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?ld\.global(?:\.\w+)*\.[bsu]8\s", re.MULTILINE
)


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


def _stage1_byte_loads(monkeypatch, preset: str) -> dict[str, int]:
    """Decodes one step of two requests with ``preset`` through the backend,
    checks the output against SDPA, and counts the single-byte global loads
    in the token loop of each stage-1 kernel it launched."""
    device = torch.device("cuda")
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
        device=device,
    ).transpose(1, 2)
    seq_lens = [c + 1 for c in CONTEXT_LENS]
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randn(2, s, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(
            device, torch.bfloat16
        )
        for s in seq_lens
    ]
    for i, (k_i, v_i) in enumerate(kv):
        slots = torch.arange(seq_lens[i], device=device) + i * MAX_BLOCKS * BLOCK_SIZE
        impl.do_kv_cache_update(layer, k_i, v_i, kv_cache, slots)
    q = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen)
    q = q.to(device, torch.bfloat16)
    query_start_loc = torch.arange(n + 1, dtype=torch.int32)
    slots = [i * MAX_BLOCKS * BLOCK_SIZE + s - 1 for i, s in enumerate(seq_lens)]
    cam = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(
            n * MAX_BLOCKS, dtype=torch.int32, device=device
        ).view(n, MAX_BLOCKS),
        slot_mapping=torch.tensor(slots, device=device),
        causal=True,
    )
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=cam)
    k, v = (torch.cat([x[j][-1:] for x in kv]) for j in range(2))
    launched = []
    run = JITFunction.run

    def recording_run(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        launched.append((self.fn.__name__, kernel))
        return kernel

    with monkeypatch.context() as m:
        m.setattr(JITFunction, "run", recording_run)
        out = impl.forward(layer, q, k, v, kv_cache, metadata).view(q.shape)

    for i, (k_i, v_i) in enumerate(kv):
        ref = F.scaled_dot_product_attention(
            q[i, :, None].float(),
            k_i.float().transpose(0, 1),
            v_i.float().transpose(0, 1),
            scale=HEAD_SIZE**-0.5,
            enable_gqa=True,
        )[:, 0]
        # 3-bit codes of random vectors: about 0.94 with or without this change
        cos = F.cosine_similarity(out[i].float(), ref, dim=-1)
        assert cos.min() > 0.9, f"request {i}: min cosine {cos.min():.3f}"
    stage1 = [(name, kernel) for name, kernel in launched if "stage1" in name]
    assert stage1, f"no stage-1 decode kernel ran: {[n for n, _ in launched]}"
    return {name: len(BYTE_LOAD.findall(_token_loop(name, k))) for name, k in stage1}


def _token_loop(name: str, kernel) -> str:
    """The PTX from the label of the kernel's longest backward branch to it."""
    ptx = kernel.asm["ptx"]
    labels = {m.group(1): m.start() for m in re.finditer(r"(\$L__BB\d+_\d+):", ptx)}
    loops = [
        ptx[labels[m.group(1)] : m.start()]
        for m in BRANCH.finditer(ptx)
        if labels.get(m.group(1), m.start()) < m.start()
    ]
    assert loops, f"{name}: no loop in its PTX"
    return max(loops, key=len)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="compiles the decode for this CUDA GPU"
)
def test_3bit_codes_loaded_as_words(monkeypatch):
    # A byte at a time, a key's 48 code bytes and a value's 48 would take 48
    # loads a lane in each step of 16 tokens on one warp.
    code_bytes = HEAD_SIZE * 3 // 8
    byte_loads = _stage1_byte_loads(monkeypatch, "turboquant_3bit_nc")
    for name, loads in byte_loads.items():
        assert loads < code_bytes, (
            f"{name} loads the 3-bit codes a byte at a time: {loads} byte "
            f"loads in its token loop ({code_bytes} code bytes a vector)"
        )
