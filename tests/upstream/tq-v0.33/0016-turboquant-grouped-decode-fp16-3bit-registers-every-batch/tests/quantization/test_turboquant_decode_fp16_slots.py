# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode: fp16 queries on 3-bit keys in registers.

With fp16 queries and many (request, KV head) programs, 3-bit keys took the
first stage 1, which gathers each code's centroid from memory and slows
down with the batch. Up to head size 128 they now run the registers stage
1 at every batch. Checked: a decode step with fp16 queries and many
programs launches it and agrees with v0.33.0's kernel.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.ops.triton_turboquant_decode import (
    triton_turboquant_decode_attention,
)
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 128, 16
NUM_TOKENS, NUM_BLOCKS = 40, 4
GROUPED = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


def _vllm_config():
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=2, max_num_batched_tokens=2048, enable_chunked_prefill=True
        ),
        model_config=SimpleNamespace(
            max_model_len=NUM_BLOCKS * BLOCK_SIZE,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: NUM_HEADS,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        kv_transfer_config=None,
    )


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k3v4_nc"])
def test_fp16_three_bit_presets_decode_in_registers(monkeypatch, preset):
    assert importlib.util.find_spec(GROUPED) is not None, "no grouped decode"
    gd = importlib.import_module(GROUPED)
    launched = []

    class Recorded:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, kwargs.get("num_warps")))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for attr in ("_tq_grouped_decode_stage1", "_tq_grouped_decode_regs_stage1"):
        monkeypatch.setattr(gd, attr, Recorded(getattr(gd, attr), attr))
    # As many programs as on a GPU of two SMs: 2 requests x 2 KV heads.
    monkeypatch.setattr(gd, "_num_sms", lambda device: 2)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config()
    monkeypatch.setattr(turboquant_attn, "get_current_vllm_config", lambda: vllm_config)
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
        device, torch.float16
    )
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, cfg.slot_size_aligned)
    cache = torch.zeros(shape, dtype=torch.uint8, device=device)
    packing = {
        "mse_bits": cfg.key_mse_bits,
        "key_packed_size": cfg.key_packed_size,
        "value_quant_bits": cfg.effective_value_quant_bits,
        "key_fp8": cfg.key_fp8,
    }
    slot_mapping = torch.arange(NUM_TOKENS, device=device) + BLOCK_SIZE
    triton_turboquant_store(
        k, v, cache, slot_mapping, layer._tq_PiT, layer._tq_midpoints, **packing
    )
    query = torch.randn(2, NUM_HEADS, HEAD_SIZE, generator=gen)
    args = {
        "query": query.to(device, torch.float16),
        "kv_cache": cache,
        "block_table": torch.tensor([[1, 2, 3]] * 2, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([NUM_TOKENS, 23], dtype=torch.int32, device=device),
        "centroids": layer._tq_centroids,
        "scale": impl.scale,
        "norm_correction": cfg.norm_correction,
        **packing,
    }
    got = gd.triton_turboquant_grouped_decode_attention(
        num_kv_splits=2, PiT=layer._tq_PiT, **args
    )
    assert launched == [("_tq_grouped_decode_regs_stage1", 1)], (
        f"3-bit codes with fp16 queries and many programs decoded by "
        f"{launched}, not the registers stage 1"
    )
    want = triton_turboquant_decode_attention(Pi=layer._tq_Pi, **args)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
