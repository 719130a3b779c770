# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode dequantizes 4-bit codes in the MMA's registers.

The grouped decode's stage 1 unpacked each block's code bytes into fp16
[BLOCK_KV, D / 2] tiles and stored them to shared memory every step, the
MMA's B operand: a third of its loop was byte permutes and the stores, and
it ran below the cache's copy rate. With 4-bit codes the tiles are now built
in the MMA's operand registers. Checked in the compiled kernel's TTGIR: its
loop runs the MMA, and stores no cache tile of head-size width to shared
memory.
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
LOCAL_ALLOC = re.compile(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+)x(f16|bf16|f32)")
MMA = re.compile(r"\b(tt\.dot|ttng\.warp_group_dot)\b")


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


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="compiles the decode for this CUDA GPU"
)
def test_4bit_codes_dequantized_in_registers(monkeypatch):
    device = torch.device("cuda")
    # 4-bit MSE keys and values: FP8 keys already reached the MMA as bytes.
    preset = "turboquant_4bit_nc"
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
        cos = F.cosine_similarity(out[i].float(), ref, dim=-1)
        assert cos.min() > 0.95, f"request {i}: min cosine {cos.min():.3f}"
    stage1 = [(name, kernel) for name, kernel in launched if "stage1" in name]
    assert stage1, f"no stage-1 decode kernel ran: {[n for n, _ in launched]}"
    for name, kernel in stage1:
        ttgir = kernel.asm["ttgir"]
        loop = ttgir[ttgir.index("scf.for") : ttgir.rindex("scf.yield")]
        wide = [
            f"{shape}x{dtype}"
            for shape, dtype in LOCAL_ALLOC.findall(loop)
            if {HEAD_SIZE, HEAD_SIZE // 2} & {int(d) for d in shape.split("x")}
        ]
        why = (
            f"it stores dequantized cache tiles ({', '.join(wide)}) to shared "
            "memory every step, the MMA's operand"
            if wide
            else "its loop runs no MMA"
        )
        assert MMA.search(loop) and not wide, (
            f"{name} does not dequantize the 4-bit codes in the MMA's registers: {why}"
        )
