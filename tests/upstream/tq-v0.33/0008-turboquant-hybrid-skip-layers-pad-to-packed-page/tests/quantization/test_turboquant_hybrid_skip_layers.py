# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant KV cache pages on a hybrid (attention + Mamba) model with
--kv-cache-dtype-skip-layers.

The block-size planning of a Jamba-v0.1-shaped model (8 KV heads of 128,
bf16, a 573,440 B Mamba state) is run as the worker runs it, then each
layer's KV cache spec is built as the runner builds it. TurboQuant layers
must keep their packed bytes per token: the shared page is the TurboQuant
page, and the skip layer and the Mamba state are padded up to it, not the
other way round.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import CacheConfig
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.model_executor.models import ModelRegistry
from vllm.platforms.interface import Platform
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.kv_cache_interface import MambaSpec

NUM_KV_HEADS, HEAD_SIZE = 8, 128
ATTENTION_LAYERS = (4, 12, 20, 28)
MAMBA_SHAPES = ((8192, 3), (8192, 16))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)


class _JambaLike:
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return MAMBA_SHAPES

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return MAMBA_DTYPES


class _AttentionLayer(AttentionLayerBase):
    """An attention layer as the model builds it: TurboQuant, or a skip
    layer left in the model dtype on FlashAttention."""

    attn_type = "decoder"
    num_kv_heads = NUM_KV_HEADS
    head_size = head_size_v = HEAD_SIZE
    sliding_window = None

    def __init__(self, kv_cache_dtype: str):
        quantized = kv_cache_dtype.startswith("turboquant_")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache_torch_dtype = torch.uint8 if quantized else torch.bfloat16
        self.attn_backend = (
            TurboQuantAttentionBackend if quantized else FlashAttentionBackend
        )

    def get_attn_backend(self):
        return self.attn_backend

    def get_kv_cache_spec(self, vllm_config):
        return Attention.get_kv_cache_spec(self, vllm_config)


def _hybrid_config(preset: str, skipped: int):
    layers = {
        f"model.layers.{i}.self_attn.attn": _AttentionLayer(
            "auto" if i == skipped else preset
        )
        for i in ATTENTION_LAYERS
    }
    return SimpleNamespace(
        cache_config=CacheConfig(
            cache_dtype=preset, kv_cache_dtype_skip_layers=[str(skipped)]
        ),
        model_config=SimpleNamespace(
            is_hybrid=True,
            use_mla=False,
            dtype=torch.bfloat16,
            architecture="JambaForCausalLM",
            get_num_kv_heads=lambda parallel_config: NUM_KV_HEADS,
            get_head_size=lambda: HEAD_SIZE,
        ),
        parallel_config=SimpleNamespace(),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    ), layers


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("skipped", [ATTENTION_LAYERS[0], ATTENTION_LAYERS[-1]])
def test_hybrid_skip_layers_keep_turboquant_packed_page(monkeypatch, preset, skipped):
    monkeypatch.setattr(
        ModelRegistry,
        "resolve_model_cls",
        lambda *args, **kwargs: (_JambaLike, "JambaForCausalLM"),
    )
    vllm_config, layers = _hybrid_config(preset, skipped)
    Platform.update_block_size_for_backend(vllm_config)

    cache_config = vllm_config.cache_config
    block_size = cache_config.block_size
    # The worker's spec-collection loop applies the backends' packing.
    specs = {
        name: layer.attn_backend.customize_spec(layer.get_kv_cache_spec(vllm_config))
        for name, layer in layers.items()
    }
    packed = (
        TurboQuantConfig.from_cache_dtype(preset, HEAD_SIZE).slot_size_aligned
        * NUM_KV_HEADS
    )
    # unify_kv_cache_spec_page_size pads every page up to the largest one:
    # TurboQuant's bytes per token are the largest page over the block size.
    largest = max(spec.page_size_bytes for spec in specs.values())
    assert largest == block_size * packed, (
        f"every page is padded to {largest} B: TurboQuant layers take "
        f"{largest // block_size} B/token, not their packed {packed}"
    )
    # One page size, the Mamba state's padded to it too.
    assert {spec.page_size_bytes for spec in specs.values()} == {largest}
    assert cache_config.mamba_page_size_padded == largest
    mamba_page = MambaSpec(
        shapes=MAMBA_SHAPES, dtypes=MAMBA_DTYPES, block_size=-1
    ).page_size_bytes
    kernel_block = 16
    assert mamba_page <= largest < mamba_page + kernel_block * packed
    # The skip layer keeps its native layout, padded by less than a kernel
    # block of its own.
    skip = specs[f"model.layers.{skipped}.self_attn.attn"]
    native = skip.real_page_size_bytes // skip.block_size
    assert native == 2 * NUM_KV_HEADS * HEAD_SIZE * torch.bfloat16.itemsize
    assert largest - skip.real_page_size_bytes < kernel_block * native
