# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode: 32 tokens a step on one warp where they fit.

With many programs the registers stage 1 runs under a register cap; at head
sizes up to 128 with up to 8 query heads a KV head, 32 tokens a step on one
warp fit it without spills and take fewer instructions a token than 16.
Checked: a decode step with many programs (turboquant_4bit_nc, bf16 queries,
head size 128) launches 32 tokens on one warp and agrees with v0.33.0's
kernel over slots holding the same values.
"""

import importlib
import torch

from vllm.model_executor.layers.quantization.turboquant.centroids import (
    get_centroids,
)
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops.triton_turboquant_decode import (
    triton_turboquant_decode_attention,
)
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.attention.ops.turboquant_soa.triton_turboquant_store import (
    triton_turboquant_store as soa_store,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 128, 16
NUM_TOKENS, NUM_BLOCKS = 40, 4
GROUPED = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


def test_32_tokens_on_one_warp(monkeypatch):
    dtype = torch.bfloat16
    gd = importlib.import_module(GROUPED)
    launched = []

    class Recorded:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, kwargs["BLOCK_KV"], kwargs.get("num_warps")))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for attr in ("_tq_grouped_decode_stage1", "_tq_grouped_decode_regs_stage1"):
        monkeypatch.setattr(gd, attr, Recorded(getattr(gd, attr), attr))
    # As many programs as on a GPU of two SMs: 2 requests x 2 KV heads.
    monkeypatch.setattr(gd, "_num_sms", lambda device: 2)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", HEAD_SIZE)
    assert gd.grouped_decode_soa_pages(
        config.key_fp8, config.key_mse_bits, config.effective_value_quant_bits
    ), "turboquant_4bit_nc's pages are not turboquant_soa's"
    pit = _build_hadamard(HEAD_SIZE, str(device))
    centroids = get_centroids(HEAD_SIZE, config.centroid_bits).float().to(device)
    ordered = centroids.sort()[0]
    midpoints = (ordered[1:] + ordered[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(
        device, dtype
    )
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, config.slot_size_aligned)
    slots, pages = (torch.zeros(shape, dtype=torch.uint8, device=device) for _ in "ab")
    packing = {
        "mse_bits": config.key_mse_bits,
        "key_packed_size": config.key_packed_size,
        "value_quant_bits": config.effective_value_quant_bits,
        "key_fp8": config.key_fp8,
    }
    slot_mapping = torch.arange(NUM_TOKENS, device=device) + BLOCK_SIZE
    rotation = (pit, midpoints)
    triton_turboquant_store(k, v, slots, slot_mapping, *rotation, **packing)
    soa_store(k, v, pages, slot_mapping, *rotation, **packing,
              centroids=centroids, norm_correction=False)  # fmt: skip
    query = torch.randn(2, NUM_HEADS, HEAD_SIZE, generator=gen)
    args = {
        "query": query.to(device, dtype),
        "block_table": torch.tensor([[1, 2, 3]] * 2, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([NUM_TOKENS, 23], dtype=torch.int32, device=device),
        "centroids": centroids,
        "scale": HEAD_SIZE**-0.5,
        "norm_correction": config.norm_correction,
        **packing,
    }
    got = gd.triton_turboquant_grouped_decode_attention(
        kv_cache=pages, soa_layout=True, num_kv_splits=2, PiT=pit, **args
    )
    assert launched == [("_tq_grouped_decode_regs_stage1", 32, 1)], (
        f"turboquant_4bit_nc at head size 128 with many programs decoded by "
        f"(kernel, tokens a step, warps) {launched}, not 32 tokens on one warp"
    )
    want = triton_turboquant_decode_attention(kv_cache=slots, Pi=pit, **args)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
