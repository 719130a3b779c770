"""Targeted tests of tq/0003 and tq-v0.33/0008: TurboQuant KV cache on hybrid
models.

v0.20.2's ``EngineArgs.create_engine_config`` refuses ``turboquant_*`` KV
cache dtypes for every hybrid (attention + Mamba / linear-attention) model,
and its hybrid page-size planner (``Platform._align_hybrid_block_size``)
sizes attention pages as if K and V were stored apart in the cache dtype,
which is not TurboQuant's packed layout. The patch lifts the gate, finds
the full-attention layers from the model config and sizes the hybrid page
from TurboQuant's packed slot (and from the native layout of layers the
user keeps out of TurboQuant).

Everything runs through the real configuration code of the tree under test,
on model configs built here (no download). What is stubbed, and why:

* ``cpu_platform`` (conftest): an uninstalled tree finds no platform.
* ``registry._run_in_subprocess`` runs in this process: vLLM inspects model
  classes in a fresh ``python -m vllm...`` subprocess (to keep CUDA
  uninitialised in the parent), and that subprocess cannot import an
  uninstalled tree. Its modelinfo cache goes to a temporary
  ``VLLM_CACHE_ROOT``.
* The Qwen3.5 preset keeps Qwen3.5's real config (``model_type`` qwen3_5,
  layer pattern nested in ``text_config``, architecture
  ``Qwen3_5ForConditionalGeneration``, so its ``verify_and_update_config``
  runs), but the architecture resolves to ``Qwen3NextForCausalLM``: vLLM's
  ``qwen3_5`` module imports Qwen3-VL image processors that need
  torchvision, which the CPU test environment does not have. Its language
  model is Qwen3-Next's and ``test_qwen3_5_stub_matches_tree`` checks that
  the two classes' Mamba-state methods are the same code.
* The page-size path is the one a GPU worker runs after building the model:
  the model's attention layers (real ``Attention`` modules, registered in
  the config's forward context as the model constructor registers them),
  then ``Platform.update_block_size_for_backend`` (the base class's: the CPU
  platform overrides it), which finds their backends itself, then each
  layer's KV cache spec as the runner makes it. The backend selector is
  replaced by CUDA's outcome (TURBOQUANT for ``turboquant_*`` layers,
  FLASH_ATTN otherwise). Mamba layers' specs come from the tree's
  ``MambaBase.get_kv_cache_spec`` on a ``MambaBase`` holding only the model
  class's state shapes (building real GDN/Mamba layers would allocate their
  weights).
* ``llguidance`` / ``xgrammar`` (structured-output backends, not in the CPU
  environment) get empty stand-in modules when missing:
  ``vllm.v1.core.kv_cache_utils`` imports them through ``vllm.v1.request``
  at class-definition time; the KV cache grouping under test never uses
  them.
* ``CpuPlatform.check_and_update_config`` writes process environment
  variables; they are restored after each test.

The tests run on every release from v0.20.0 on; ``tqharness`` finds what
moved by probing each tree's API (the TurboQuant spec class, gone in v0.28.0;
planner functions moved to ``kv_cache_planning`` in v0.33.0; the
full-attention layer finder, private upstream from v0.21.0). v0.20.x has the
bug everywhere: tests that need a hybrid TurboQuant engine config carry the
gate's signature. Upstream #39931 (v0.21.0) lifted the gate and sizes the
hybrid page from TurboQuant's slot, as tq/0003 does.

v0.28.0-v0.33.0 have the bug of tq-v0.33/0008 (``SKIP_PADDED``): with
skip layers on a hybrid, a block-size step after the hybrid planning prices
TurboQuant through the first attention layer's backend and leaves
full-attention skip pages the largest, so every page is padded up to them
(v0.28.0 cannot pad TurboQuant pages and fails instead: ``SKIP_UNPADDABLE``).
``page_plan``, ``tokens_that_fit`` and ``capacity`` are also what
``ci/kv_capacity.py`` prints.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import math
import os
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import tqharness as h
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

TQ_PRESETS = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
# (key bits, value bits) of each preset; 8-bit keys are stored as FP8.
TQ_BITS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}


# --------------------------------------------------------------------------
# Model configs (transformers config classes; nothing is downloaded)
# --------------------------------------------------------------------------


# Published shapes; vocab_size is kept small, nothing else is changed.
QWEN3_5_9B_TEXT = dict(
    num_hidden_layers=32,
    full_attention_interval=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    hidden_size=4096,
    intermediate_size=12288,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=1024,
)
QWEN3_NEXT_80B = {  # the same linear-attention shape; the MLP left default
    **{k: v for k, v in QWEN3_5_9B_TEXT.items() if k != "intermediate_size"},
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "hidden_size": 2048,
    "architectures": ["Qwen3NextForCausalLM"],
}
# The attention shape Jamba-v0.1 and Llama-3-8B share.
GQA_32_8 = dict(
    num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, vocab_size=1024
)
JAMBA_V0_1 = dict(
    GQA_32_8,
    num_hidden_layers=32,
    attn_layer_period=8,
    attn_layer_offset=4,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    architectures=["JambaForCausalLM"],
)
LLAMA_3_8B = dict(
    GQA_32_8, max_position_embeddings=4096, architectures=["LlamaForCausalLM"]
)


def hf_config(cls_name: str, shape: dict[str, Any], **overrides: Any) -> Any:
    """A transformers config of that class: the shape, with overrides."""
    import transformers

    return getattr(transformers, cls_name)(**{**shape, **overrides})


def qwen3_5_9b() -> Any:
    """Qwen3.5-9B's text config, nested as in the released checkpoint."""
    return hf_config(
        "Qwen3_5Config",
        {"architectures": ["Qwen3_5ForConditionalGeneration"]},
        text_config=QWEN3_5_9B_TEXT,
    )


def qwen3_next(**overrides: Any) -> Any:
    """Qwen3-Next-80B-A3B's shape: 48 layers, full attention every 4th."""
    return hf_config("Qwen3NextConfig", QWEN3_NEXT_80B, **overrides)


def jamba(**overrides: Any) -> Any:
    """Jamba-v0.1's shape: 32 layers, attention at 4, 12, 20, 28."""
    return hf_config("JambaConfig", JAMBA_V0_1, **overrides)


def llama(num_hidden_layers: int = 32) -> Any:
    """Dense control: Llama-3-8B's attention shape."""
    return hf_config("LlamaConfig", LLAMA_3_8B, num_hidden_layers=num_hidden_layers)


# Expected full-attention layers, written from each model's published layer
# pattern rather than read back from the config objects.
HYBRIDS = {
    "qwen3_5_9b": (qwen3_5_9b, [i for i in range(32) if i % 4 == 3]),
    "qwen3_next": (qwen3_next, [i for i in range(48) if i % 4 == 3]),
    "jamba": (jamba, [4, 12, 20, 28]),
}


# v0.20.x refuses every turboquant_* dtype on a hybrid (engine/arg_utils.py).
GATE = r"TurboQuant KV cache is not supported for hybrid \(attention \+ Mamba\)"


def v0202_boundary_skip_layers(num_layers: int) -> list[str]:
    """v0.20.2's dense boundary protection: first and last 2 layers."""
    n = min(2, num_layers // 2)
    return [str(i) for i in sorted({*range(n), *range(num_layers - n, num_layers)})]


def tq_slot_bytes(preset: str, head_size: int) -> int:
    """Packed K|V bytes per KV head and token (TurboQuant's layout)."""
    key_bits, value_bits = TQ_BITS[preset]
    # FP8 keys take one byte per element; MSE keys their indices + fp16 norm.
    key = head_size if key_bits == 8 else math.ceil(head_size * key_bits / 8) + 2
    value = math.ceil(head_size * value_bits / 8) + 4  # data + fp16 scale, zero
    slot = key + value
    return slot + slot % 2


# --------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------


@pytest.fixture
def restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def use_engine_env(monkeypatch, cache_root: Path) -> None:
    """Lets ``EngineArgs.create_engine_config`` run on a CPU-only host (the
    module docstring says what and why); ``monkeypatch`` undoes it."""
    import vllm.model_executor.models.registry as registry

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_root))
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())
    monkeypatch.setitem(
        registry.ModelRegistry.models,
        "Qwen3_5ForConditionalGeneration",
        registry._LazyRegisteredModel(
            module_name="vllm.model_executor.models.qwen3_next",
            class_name="Qwen3NextForCausalLM",
        ),
    )


@pytest.fixture
def engine_env(cpu_platform, restore_environ, monkeypatch, tmp_path_factory):
    """Lets ``EngineArgs.create_engine_config`` run on a CPU-only host."""
    use_engine_env(monkeypatch, tmp_path_factory.mktemp("vllm"))
    return cpu_platform


@pytest.fixture
def tq_log(caplog) -> pytest.LogCaptureFixture:
    """INFO messages, in ``tq_log.messages`` (logged by
    ``create_engine_config`` with tq/0003, by TurboQuant's config module
    upstream), whatever level ``VLLM_LOGGING_LEVEL`` gives vLLM's logger."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="vllm")
    return caplog


class _StandInModule(types.ModuleType):
    """A missing optional dependency whose names appear only in annotations."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def stand_in_optional_modules(monkeypatch) -> None:
    """Empty stand-ins for the structured-output backends where missing
    (module docstring)."""
    for name in ("llguidance", "xgrammar"):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            monkeypatch.setitem(sys.modules, name, _StandInModule(name))


@pytest.fixture
def kv_cache_utils(monkeypatch):
    stand_in_optional_modules(monkeypatch)
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    return kv_cache_utils


def engine_config(
    hf_config: Any,
    model_dir: Path,
    kv_cache_dtype: str = "turboquant_4bit_nc",
    skip_layers: list[str] | None = None,
) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    hf_config.save_pretrained(model_dir)
    return EngineArgs(
        model=str(model_dir),
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_dtype_skip_layers=list(skip_layers or []),
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=2,
    ).create_engine_config()


def hybrid_engine_config(hf_config: Any, model_dir: Path, **kwargs: Any) -> Any:
    """``engine_config`` for tests beyond the gate: a tree that refuses
    TurboQuant on hybrids (v0.20.x) fails them with that finding."""
    try:
        return engine_config(hf_config, model_dir, **kwargs)
    except NotImplementedError as e:
        if re.search(GATE, str(e)):
            pytest.fail(f"TurboQuant refused on a hybrid (the gate): {e}")
        raise


def attention_layer_indices(vllm_config: Any) -> list[int]:
    """Decoder indices of attention layers, read the way the models do."""
    text_config = vllm_config.model_config.hf_text_config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return [i for i, t in enumerate(layer_types) if t == "full_attention"]
    block_types = text_config.layers_block_type  # Jamba
    return [i for i, t in enumerate(block_types) if t == "attention"]


def build_attention_layers(
    vllm_config: Any, indices: list[int], monkeypatch
) -> dict[int, Any]:
    """The model's attention layers at these decoder indices, each on the
    backend its KV cache dtype selects (TurboQuant or FlashAttention), then
    the block size planned for them, as model loading does."""
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.config import set_current_vllm_config
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import (
        TurboQuantAttentionBackend,
    )

    def select_backend(head_size, dtype, kv_cache_dtype, **kwargs):
        if kv_cache_dtype.startswith("turboquant_"):
            return TurboQuantAttentionBackend
        return FlashAttentionBackend

    monkeypatch.setattr(attention, "get_attn_backend", select_backend)
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    layers = {}
    with set_current_vllm_config(vllm_config):
        for i in indices:
            layers[i] = attention.Attention(
                model_config.get_num_attention_heads(parallel_config),
                model_config.get_head_size(),
                1.0,
                num_kv_heads=model_config.get_num_kv_heads(parallel_config),
                cache_config=vllm_config.cache_config,
                prefix=f"model.layers.{i}.self_attn.attn",
            )
    # After the model is built (its layers name their backends).
    Platform.update_block_size_for_backend(vllm_config)
    return layers


def build_kv_cache_specs(vllm_config: Any, monkeypatch) -> tuple[dict, dict]:
    """Build the model's attention layers, plan the hybrid block size and
    build each layer's KV cache spec, as a GPU worker does (see module
    docstring)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    layers = build_attention_layers(
        vllm_config, attention_layer_indices(vllm_config), monkeypatch
    )
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    mamba_layer = h.mamba_state_layer(
        model_cls.get_mamba_state_shape_from_config(vllm_config),
        model_cls.get_mamba_state_dtype_from_config(vllm_config),
    )
    attn_specs = h.runner_kv_cache_specs(vllm_config)
    specs: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    with set_current_vllm_config(vllm_config):
        for i in range(model_config.hf_text_config.num_hidden_layers):
            if i in layers:
                layer = layers[i]
                specs[layer.layer_name] = attn_specs[layer.layer_name]
                backends[layer.layer_name] = layer.get_attn_backend()
            else:
                name = f"model.layers.{i}.mixer"
                specs[name] = mamba_layer.get_kv_cache_spec(vllm_config)
    return specs, backends


def build_dense_kv_cache_specs(vllm_config: Any, monkeypatch) -> tuple[dict, dict]:
    """``build_kv_cache_specs`` for a dense model: every layer attention."""
    num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    layers = build_attention_layers(vllm_config, list(range(num_layers)), monkeypatch)
    specs = h.runner_kv_cache_specs(vllm_config)
    return specs, {x.layer_name: x.get_attn_backend() for x in layers.values()}


def check_kv_cache_specs(
    vllm_config: Any,
    specs: dict,
    backends: dict,
    kv_cache_utils: Any,
    preset: str,
    tq_layers: list[int],
    native_layers: list[int],
    raise_grouping_errors: bool = False,
) -> None:
    """The invariants the KV cache manager and the runner rely on. A KV
    cache grouping that raises fails the test with its message (the
    regression test keeps the exception, for its signature)."""
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    tq_token = num_kv_heads * tq_slot_bytes(preset, head_size)
    native_token = num_kv_heads * 2 * head_size * model_config.dtype.itemsize
    by_kind = layer_kinds(specs, tq_token, native_token)
    assert by_kind["tq"] == tq_layers
    assert by_kind["native"] == native_layers
    groups = grouped(vllm_config, specs, raise_grouping_errors)
    page = shared_page(vllm_config, groups, specs, backends, tq_token, native_token)
    # That page is the Mamba state page, padded, and every layer's own page
    # divides it.
    mamba_pages = {
        specs[f"model.layers.{i}.mixer"].page_size_bytes for i in by_kind["mamba"]
    }
    assert mamba_pages == {page}, (
        f"Mamba state pages {mamba_pages} differ from the shared page {page}: "
        "the KV cache manager pads them again"
    )
    # Padded unless the state happens to fill whole attention pages already.
    assert vllm_config.cache_config.mamba_page_size_padded in (None, page)
    if not native_layers:
        # Without skip layers: block_size TurboQuant tokens.
        assert page == vllm_config.cache_config.block_size * tq_token
    for spec in specs.values():
        assert page % spec.page_size_bytes == 0
    check_runner_fits(vllm_config, groups, specs, backends, page)


def build_and_check_kv_cache_specs(
    vllm_config: Any, monkeypatch, kv_cache_utils: Any, preset: str, *args, **kw
) -> None:
    """``build_kv_cache_specs``, then ``check_kv_cache_specs`` on them."""
    specs, backends = build_kv_cache_specs(vllm_config, monkeypatch)
    check_kv_cache_specs(
        vllm_config, specs, backends, kv_cache_utils, preset, *args, **kw
    )


def layer_kinds(specs: dict, tq_token: int, native_token: int) -> dict:
    """Layer indices by kind (TurboQuant, native attention, Mamba), each
    attention page holding its layout's bytes per token (TurboQuant pages
    unpadded; a native page may be padded, see ``shared_page``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    by_kind: dict[str, list[int]] = {"tq": [], "native": [], "mamba": []}
    for name, spec in specs.items():
        index = int(name.split(".")[2])
        if h.is_turboquant_spec(spec):
            by_kind["tq"].append(index)
            assert spec.page_size_bytes == spec.block_size * tq_token
        elif isinstance(spec, AttentionSpec):
            by_kind["native"].append(index)
            assert spec.real_page_size_bytes == spec.block_size * native_token
        else:
            assert isinstance(spec, MambaSpec)
            by_kind["mamba"].append(index)
    return by_kind


def grouped(vllm_config: Any, specs: dict, raise_errors: bool) -> list[Any]:
    """The KV cache groups; a grouping that raises fails the test with its
    place in the tree (or raises, for a regression test's signature)."""
    try:
        return h.kv_cache_groups(vllm_config, specs)
    except (NotImplementedError, AssertionError) as e:
        if raise_errors:
            raise
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(frame.filename).relative_to(h.tree_root())}:{frame.lineno}"
        pytest.fail(f"KV cache grouping fails: {type(e).__name__} at {where}: {e}")


def smallest_kernel_block(vllm_config: Any, backends: Any) -> int:
    """The smallest kernel block size every one of these backends takes."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import MultipleOf

    with set_current_vllm_config(vllm_config):
        return math.lcm(
            *(
                min(
                    size.base if isinstance(size, MultipleOf) else size
                    for size in backend.get_supported_kernel_block_sizes()
                )
                for backend in backends
            )
        )


def shared_page(
    vllm_config: Any,
    groups: list,
    specs: dict,
    backends: dict,
    tq_token: int,
    native_token: int,
) -> int:
    """The one physical page size the KV cache manager gives all groups (it
    raises when a layer's page does not divide the largest one).

    TurboQuant groups hold exactly their packed bytes per token: padding
    their pages up to another kind's gives back what they save. Native
    (skip) groups hold their layout's bytes per token, their pages padded by
    less than one more kernel block (as v0.33.0 pads sliding-window skip
    layers up to the shared page). Mamba pages are padded."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    assert len(pages) == 1
    for group in groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        kinds = {h.is_turboquant_spec(specs[name]) for name in group.layer_names}
        assert len(kinds) == 1
        tq = kinds == {True}
        own = tq_token if tq else native_token
        held = spec.page_size_bytes if tq else spec.real_page_size_bytes
        per_token = held / spec.block_size
        assert per_token == own, (
            f"{'TurboQuant' if tq else 'native'} attention layers "
            f"{group.layer_names} get {per_token:g} bytes per token, their "
            f"layout needs {own} (TurboQuant {tq_token}, native {native_token}): "
            "pages padded to another kind's size"
        )
        kernel = smallest_kernel_block(
            vllm_config, {backends[name] for name in group.layer_names}
        )
        assert spec.page_size_bytes < (spec.block_size + kernel) * own, (
            f"{group.layer_names}: a {spec.page_size_bytes} B page for "
            f"{spec.block_size} tokens of {own} B: padded by a kernel block "
            f"({kernel} tokens) or more"
        )
    return pages.pop()


def check_runner_fits(
    vllm_config: Any, groups: list, specs: dict, backends: dict, page: int
) -> None:
    """The runner finds a kernel block size for every attention group, and
    the KV cache config's tensors hold every page without overlap."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import select_common_block_size

    with set_current_vllm_config(vllm_config):
        for group in groups:
            if isinstance(group.kv_cache_spec, AttentionSpec):
                group_backends = {backends[name] for name in group.layer_names}
                # Raises if no kernel block size of the backends divides the
                # group's block size: a plan the runner cannot run.
                try:
                    select_common_block_size(
                        group.kv_cache_spec.block_size, list(group_backends)
                    )
                except ValueError as e:
                    pytest.fail(f"{group.layer_names}: no kernel block size: {e}")
    (kv_cache_config,) = h.kv_cache_configs(vllm_config, [specs], [4 * 2**30])
    num_blocks = kv_cache_config.num_blocks
    assert num_blocks > 0
    for tensor in kv_cache_config.kv_cache_tensors:
        if hasattr(tensor, "layer_stride"):
            # v0.29.0+: one backing allocation; layer l, block b at offset +
            # l * layer_stride + b * block_stride. Every page fits, none
            # overlaps another.
            strides = sorted(
                [
                    (tensor.block_stride, num_blocks),
                    (tensor.layer_stride, len(tensor.layers)),
                ]
            )
            (inner, inner_count), (outer, _) = strides
            assert inner >= page and outer >= inner * inner_count
            last = (len(tensor.layers) - 1) * tensor.layer_stride
            last += (num_blocks - 1) * tensor.block_stride
            assert tensor.offset + last + page <= tensor.size
        else:
            assert tensor.size == num_blocks * page


# --------------------------------------------------------------------------
# Regression: the v0.20.2 gate
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(NotImplementedError, GATE)
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_engine_config_accepts_turboquant(engine_env, tmp_path, name):
    make_config, _ = HYBRIDS[name]
    vllm_config = engine_config(make_config(), tmp_path)
    assert vllm_config.model_config.is_hybrid
    assert vllm_config.cache_config.cache_dtype == "turboquant_4bit_nc"


# --------------------------------------------------------------------------
# Which layers use TurboQuant
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_tq_layers_are_full_attention_layers(
    engine_env, tq_log, kv_cache_utils, monkeypatch, tmp_path, name
):
    make_config, expected = HYBRIDS[name]
    vllm_config = hybrid_engine_config(make_config(), tmp_path)
    assert f"TQ hybrid: full-attention layers {expected}" in tq_log.messages
    # Boundary skips are attention layers only; none by default on a
    # hybrid, and none of v0.20.2's raw decoder indices (which are Mamba /
    # linear-attention layers here) leaks in.
    skips = vllm_config.cache_config.kv_cache_dtype_skip_layers
    assert {int(i) for i in skips} <= set(expected)
    assert skips == []
    build_and_check_kv_cache_specs(
        vllm_config, monkeypatch, kv_cache_utils, "turboquant_4bit_nc", expected, []
    )


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_user_skip_layers_keep_native_dtype(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, name
):
    make_config, expected = HYBRIDS[name]
    # The first and last attention layers, plus layer 0 (not an attention
    # layer in any of these models: it has no KV cache to keep).
    skipped = [expected[0], expected[-1]]
    vllm_config = hybrid_engine_config(
        make_config(), tmp_path, skip_layers=[str(i) for i in [0, *skipped]]
    )
    build_and_check_kv_cache_specs(
        vllm_config,
        monkeypatch,
        kv_cache_utils,
        "turboquant_4bit_nc",
        tq_layers=[i for i in expected if i not in skipped],
        native_layers=skipped,
    )


@pytest.mark.parametrize(
    "num_layers, user_skip", [(32, []), (32, ["5"]), (3, []), (1, []), (36, ["35"])]
)
def test_dense_skip_layers_unchanged(engine_env, tmp_path, num_layers, user_skip):
    vllm_config = engine_config(llama(num_layers), tmp_path, skip_layers=user_skip)
    expected = sorted(
        set(v0202_boundary_skip_layers(num_layers)) | set(user_skip), key=int
    )
    # A set of layers; its order is the tree's own (string order from v0.32.0).
    skips = vllm_config.cache_config.kv_cache_dtype_skip_layers
    assert sorted(skips, key=int) == expected and len(set(skips)) == len(skips)
    assert not vllm_config.model_config.is_hybrid


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_dense_skip_layers_one_group(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, preset
):
    """A dense model's TurboQuant and skip (boundary) layers stay in one KV
    cache group, each page its own layout's size, none padded: only hybrids
    need one page size across groups."""
    vllm_config = engine_config(llama(), tmp_path, kv_cache_dtype=preset)
    specs, _ = build_dense_kv_cache_specs(vllm_config, monkeypatch)
    assert len(grouped(vllm_config, specs, raise_errors=False)) == 1
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    tq_token = num_kv_heads * tq_slot_bytes(preset, head_size)
    native_token = num_kv_heads * 2 * head_size * model_config.dtype.itemsize
    for name, spec in specs.items():
        own = tq_token if h.is_turboquant_spec(spec) else native_token
        assert spec.page_size_bytes == spec.block_size * own, name


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_dense_block_size_kept(
    engine_env, monkeypatch, tmp_path: Path, preset: str
) -> None:
    """A dense model with boundary skip layers (every dense TurboQuant
    deployment: the engine adds them) keeps the block size its first
    attention layer's backend plans: only a hybrid's groups share one page,
    so only there is the quantized primary priced by its own layers."""
    from vllm.platforms.interface import Platform

    def planned_block_size(model_dir: Path) -> int:
        vllm_config = engine_config(llama(), model_dir, kv_cache_dtype=preset)
        with pytest.MonkeyPatch.context() as mp:
            build_dense_kv_cache_specs(vllm_config, mp)
        return vllm_config.cache_config.block_size

    got = planned_block_size(tmp_path / "patched")
    monkeypatch.setattr(
        Platform,
        "_find_quantized_kv_backend",
        classmethod(lambda cls, c: None),
        raising=False,
    )
    want = planned_block_size(tmp_path / "first_backend")
    assert got == want, f"dense block size {got}, {want} by the first backend"


@pytest.mark.parametrize("preset", TQ_PRESETS)
def test_spec_from_a_cache_config_with_the_block_size_alone(
    engine_env, tmp_path: Path, preset: str
) -> None:
    """A TurboQuant layer's spec from a config stand-in that holds the block
    size alone, as vLLM's own spec tests pass it: outside a hybrid the layer
    reads no other field (``skip_page_size_padded``, the model config)."""
    vllm_config = engine_config(llama(), tmp_path, kv_cache_dtype=preset)
    attn = h.build_tq_attention(vllm_config, 32, 128, 8)
    stand_in = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=32))
    try:
        spec = attn.get_kv_cache_spec(stand_in)
    except AttributeError as e:
        raise AssertionError(f"the spec reads more than the block size: {e}") from e
    assert spec.block_size == 32 and spec.dtype == torch.uint8, spec


@pytest.mark.parametrize(
    "name, make_config",
    [
        ("qwen3_next", lambda: qwen3_next(layer_types=["linear_attention"] * 48)),
        ("jamba", lambda: jamba(attn_layer_period=64, attn_layer_offset=40)),
    ],
)
def test_hybrid_without_attention_layer_is_rejected(
    engine_env, tmp_path, name, make_config
):
    """A clear error, not a TurboQuant cache on no layer. The wording is
    tq/0003's or upstream's (v0.21.0+: "requires identifiable full-attention
    layers, but none were found"); v0.20.x refuses every hybrid."""
    with pytest.raises(NotImplementedError) as refused:
        engine_config(make_config(), tmp_path)
    message = str(refused.value)
    assert not re.search(GATE, message), (
        f"refused by the gate on every hybrid, not for lack of attention "
        f"layers: {message}"
    )
    assert re.search(
        r"full-attention layers.*(none could be identified|none were found)", message
    ), message


def test_full_attention_layer_conventions(vllm_tree):
    """The conventions beyond the presets: MiniMax's ``attn_type_list``,
    Zamba2's "hybrid" layers, a text config nested in a multimodal one.
    The finder is tq/0003's public one or upstream's private one (v0.21.0+);
    v0.20.x has none."""
    get_full_attention_layer_indices = h.full_attention_layer_indices()
    if get_full_attention_layer_indices is None:
        pytest.fail(
            "no full-attention layer finder in turboquant/config.py: TurboQuant "
            "cannot tell a hybrid's attention layers (v0.20.x refuses hybrids)"
        )

    def model_config(text: Any, top: Any | None = None) -> Any:
        return types.SimpleNamespace(hf_text_config=text, hf_config=top or text)

    ns = types.SimpleNamespace
    minimax = ns(attn_type_list=[0] * 7 + [1] + [0] * 7 + [1])
    assert get_full_attention_layer_indices(model_config(minimax)) == [7, 15]
    zamba2 = ns(layers_block_type=["mamba", "mamba", "hybrid"] * 3)
    assert get_full_attention_layer_indices(model_config(zamba2)) == [2, 5, 8]
    nested = ns(layer_types=["linear_attention", "full_attention"] * 2)
    wrapper = ns(text_config=nested)
    assert get_full_attention_layer_indices(model_config(nested, wrapper)) == [1, 3]
    # Sliding-window layers are not full attention; nothing known: [].
    swa = ns(layer_types=["sliding_attention", "linear_attention"])
    assert get_full_attention_layer_indices(model_config(swa)) == []
    assert get_full_attention_layer_indices(model_config(ns())) == []


# --------------------------------------------------------------------------
# Page sizes
# --------------------------------------------------------------------------

# KV cache grouping fails when TurboQuant pages do not divide the padded
# Mamba page (kv_cache_utils.unify_kv_cache_spec_page_size).
UNIFY_FAILS = r"page size of the layer is not divisible by the maximum page size"


@pytest.mark.bug_signature(NotImplementedError, UNIFY_FAILS)
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_page_planner_uses_tq_slot(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, name
):
    """The planner bug on its own, past the gate: v0.20.2 sizes the attention
    page as 2 * head_size bytes per KV head and token, so TurboQuant pages
    (slot_size_aligned bytes) no longer divide the padded Mamba page and
    the KV cache manager cannot unify them. The config is created with the
    native dtype and switched to TurboQuant afterwards, as a user who
    removed the gate would have it (no skip layers on either tree)."""
    make_config, expected = HYBRIDS[name]
    vllm_config = engine_config(make_config(), tmp_path, kv_cache_dtype="auto")
    vllm_config.cache_config.cache_dtype = "turboquant_4bit_nc"
    build_and_check_kv_cache_specs(
        vllm_config,
        monkeypatch,
        kv_cache_utils,
        "turboquant_4bit_nc",
        expected,
        [],
        raise_grouping_errors=True,
    )


@pytest.mark.parametrize("preset", TQ_PRESETS)
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_page_size_unifies_with_mamba(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, name, preset
):
    make_config, expected = HYBRIDS[name]
    vllm_config = hybrid_engine_config(make_config(), tmp_path, kv_cache_dtype=preset)
    build_and_check_kv_cache_specs(
        vllm_config, monkeypatch, kv_cache_utils, preset, expected, []
    )


# --------------------------------------------------------------------------
# Regression (tq-v0.33/0008): skip layers on a hybrid
# --------------------------------------------------------------------------

# v0.33.0 prices the TurboQuant layers through the first attention layer's
# backend and bumps the block size for the skip layers after the hybrid page
# is planned; full-attention skip pages then outgrow it, and every page is
# padded up to theirs: less KV cache room than bf16.
SKIP_PADDED = r"^hybrid KV cache plan: TurboQuant layers get \d+ B/token"
# The same on v0.28.0, where TurboQuant pages cannot be padded: the KV cache
# config fails.
SKIP_UNPADDABLE = (
    r"^Layer \S+: page size is not divisible by the maximum page size and "
    r"cannot be padded"
)
CAPACITY_BUDGET = 4 * 2**30  # bytes
CAPACITY_SEQS = 8  # running sequences
# vLLM's refusal when one request of the model's length does not fit.
MAX_LEN_REFUSAL = "To serve at least one request with the model's max seq len"


def page_plan(specs: dict, groups: list) -> dict[str, Any]:
    """What the KV cache groups give each kind of layer: the bytes per token
    the TurboQuant and the native attention groups' pages hold (page over
    block size, padding included), the Mamba page and the Mamba state it
    holds, and the groups' block sizes."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    per_token: dict[str, set[float]] = {"tq": set(), "native": set()}
    mamba_pages, block_sizes = set(), set()
    for group in groups:
        spec = group.kv_cache_spec
        block_sizes.add(spec.block_size)
        if isinstance(spec, MambaSpec):
            mamba_pages.add(spec.page_size_bytes)
        elif isinstance(spec, AttentionSpec):
            kinds = {h.is_turboquant_spec(specs[name]) for name in group.layer_names}
            assert len(kinds) == 1, f"a group mixes kinds: {group.layer_names}"
            kind = "tq" if kinds.pop() else "native"
            page, block_size = spec.page_size_bytes, spec.block_size
            exact = page % block_size == 0
            per_token[kind].add(page // block_size if exact else page / block_size)
    states = {
        sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(*state))
        for state in {
            (spec.shapes, spec.dtypes)
            for spec in specs.values()
            if isinstance(spec, MambaSpec)
        }
    }
    return {
        "tq": sorted(per_token["tq"]),
        "native": sorted(per_token["native"]),
        "mamba_page": sorted(mamba_pages),
        "mamba_state": max(states, default=0),
        "groups": len(groups),
        "block_sizes": sorted(block_sizes),
    }


def tokens_that_fit(vllm_config: Any, kv_cache_config: Any, seqs: int) -> int:
    """seqs x the longest length L such that ``seqs`` running requests of L
    tokens hold their blocks: cdiv(L, block size) in each attention group,
    in each Mamba group the blocks its spec keeps per request (its
    ``max_memory_usage_bytes`` over its page)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    per_request, block_sizes = 0, []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, MambaSpec):
            usage = spec.max_memory_usage_bytes(vllm_config)
            per_request += -(-usage // spec.page_size_bytes)
        else:
            block_sizes.append(spec.block_size)

    def fits(length: int) -> bool:
        blocks = per_request + sum(-(-length // size) for size in block_sizes)
        return seqs * blocks <= kv_cache_config.num_blocks

    if not fits(0):
        return 0
    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return seqs * low


def capacity(
    vllm_config: Any, monkeypatch, refusal_fits_none: bool = False
) -> tuple[int, Any, dict, dict]:
    """Tokens that fit ``CAPACITY_BUDGET`` with ``CAPACITY_SEQS`` running
    sequences, and the KV cache config, specs and backends behind them.
    With ``refusal_fits_none``, vLLM's refusal of a budget too small for one
    request of the model's length (v0.34.0, where padded pages outgrow it)
    counts as no token fitting, and the config is None."""
    specs, backends = build_kv_cache_specs(vllm_config, monkeypatch)
    try:
        (config,) = h.kv_cache_configs(vllm_config, [specs], [CAPACITY_BUDGET])
    except ValueError as e:
        if not (refusal_fits_none and str(e).startswith(MAX_LEN_REFUSAL)):
            raise
        return 0, None, specs, backends
    return tokens_that_fit(vllm_config, config, CAPACITY_SEQS), config, specs, backends


def check_runner_caches(
    vllm_config: Any, kv_cache_config: Any, specs: dict, backends: dict, preset: str
) -> None:
    """The model runner allocates and shapes the KV cache it planned: every
    layer gets a cache, each TurboQuant layer a uint8 cache of its packed
    slots covering its group's blocks."""
    kv_caches = h.runner_kv_caches(vllm_config, kv_cache_config, backends)
    assert set(kv_caches) == set(specs)
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    slot = tq_slot_bytes(preset, model_config.get_head_size())
    block_size = {
        name: group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    tq_names = [name for name, spec in specs.items() if h.is_turboquant_spec(spec)]
    assert tq_names
    for name in tq_names:
        cache = kv_caches[name]
        # (blocks, block, heads, slot) or head-major; kernel blocks may split
        # a manager block.
        assert cache.dtype == torch.uint8 and cache.dim() == 4
        assert cache.shape[-1] == slot and num_kv_heads in cache.shape[1:3]
        tokens = cache.shape[0] * cache.shape[1] * cache.shape[2] // num_kv_heads
        assert tokens == kv_cache_config.num_blocks * block_size[name]


@pytest.mark.bug_signature(AssertionError, SKIP_PADDED)
@pytest.mark.bug_signature(NotImplementedError, SKIP_UNPADDABLE)
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
@pytest.mark.parametrize("skip", ["first", "last"])
@pytest.mark.parametrize("name", ["jamba", "qwen3_5_9b"])
def test_hybrid_skip_layers_keep_page_bytes(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, name, skip, preset
):
    """A hybrid with one attention layer kept out of TurboQuant
    (``--kv-cache-dtype-skip-layers``), planned by the tree's own planner:
    TurboQuant layers keep their packed bytes per token; the Mamba page is
    no larger than the least common alignment of both layouts needs (the
    smallest page that holds the state and whole kernel blocks of each at
    its own bytes per token); the budget holds more tokens than with bf16.
    v0.33.0 gives every attention layer the native 4096 B/token and pads
    Mamba pages 6-29x. The skip layer's own bytes and padding are checked
    with the other invariants (``check_kv_cache_specs``)."""
    make_config, expected = HYBRIDS[name]
    skipped = [expected[0] if skip == "first" else expected[-1]]
    vllm_config = hybrid_engine_config(
        make_config(),
        tmp_path / "tq",
        kv_cache_dtype=preset,
        skip_layers=[str(i) for i in skipped],
    )
    tokens, _, specs, backends = capacity(
        vllm_config, monkeypatch, refusal_fits_none=True
    )
    plan = page_plan(specs, grouped(vllm_config, specs, raise_errors=False))
    bf16_config = engine_config(make_config(), tmp_path / "bf16", kv_cache_dtype="auto")
    with monkeypatch.context() as patch:
        bf16_tokens = capacity(bf16_config, patch)[0]
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model_config.get_head_size()
    tq_token = num_kv_heads * tq_slot_bytes(preset, head_size)
    native_token = num_kv_heads * 2 * head_size * model_config.dtype.itemsize
    tq_layer = next(
        layer for layer, spec in specs.items() if h.is_turboquant_spec(spec)
    )
    skip_layer = f"model.layers.{skipped[0]}.self_attn.attn"
    unit = math.lcm(
        smallest_kernel_block(vllm_config, {backends[tq_layer]}) * tq_token,
        smallest_kernel_block(vllm_config, {backends[skip_layer]}) * native_token,
    )
    least = unit * -(-plan["mamba_state"] // unit)
    tq, native, mamba = (
        "/".join(map(str, plan[key])) for key in ("tq", "native", "mamba_page")
    )
    assert (
        plan["tq"] == [tq_token]
        and max(plan["mamba_page"]) <= least
        and tokens > bf16_tokens
    ), (
        f"hybrid KV cache plan: TurboQuant layers get {tq} B/token (layout "
        f"{tq_token}), the skip layer {native} (layout {native_token}); Mamba "
        f"page {mamba} B for a {plan['mamba_state']} B state (least common "
        f"alignment {least}); {tokens} tokens fit {CAPACITY_BUDGET >> 30} GiB "
        f"with {CAPACITY_SEQS} sequences, {bf16_tokens} with bf16"
    )
    tq_layers = [i for i in expected if i not in skipped]
    check_kv_cache_specs(
        vllm_config, specs, backends, kv_cache_utils, preset, tq_layers, skipped
    )
    (small,) = h.kv_cache_configs(vllm_config, [specs], [2**30])
    check_runner_caches(vllm_config, small, specs, backends, preset)


@st.composite
def hybrid_shapes(draw) -> dict[str, Any]:
    num_layers = draw(st.integers(2, 16))
    # At least one attention and one linear-attention (Mamba-like) layer.
    attn = draw(
        st.lists(
            st.integers(0, num_layers - 1),
            min_size=1,
            max_size=num_layers - 1,
            unique=True,
        )
    )
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    linear_key_heads = draw(st.sampled_from([1, 2, 4, 16]))
    return dict(
        layer_types=[
            "full_attention" if i in attn else "linear_attention"
            for i in range(num_layers)
        ],
        head_dim=draw(st.sampled_from([64, 80, 96, 128, 192, 256])),
        num_key_value_heads=num_kv_heads,
        num_attention_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])),
        linear_num_key_heads=linear_key_heads,
        linear_num_value_heads=linear_key_heads * draw(st.sampled_from([1, 2])),
        linear_key_head_dim=draw(st.sampled_from([64, 128])),
        linear_value_head_dim=draw(st.sampled_from([64, 128])),
        preset=draw(st.sampled_from(TQ_PRESETS)),
        skipped=sorted(draw(st.sets(st.sampled_from(sorted(attn))))),
    )


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    # One failure (the smallest), not an exception group: a verdict needs one.
    report_multiple_bugs=False,
)
@given(shape=hybrid_shapes())
# Every attention layer skipped, and a Mamba state that fills the hybrid page
# exactly (17,920 B = 256 TurboQuant tokens of 70 B; the skip layers' page then
# grows the shared page, and the Mamba page must follow): found by this test.
@example(
    shape={
        "layer_types": ["full_attention", "linear_attention"],
        "head_dim": 64,
        "num_key_value_heads": 1,
        "num_attention_heads": 1,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 128,
        "preset": "turboquant_4bit_nc",
        "skipped": [0],
    }
)
def test_hybrid_kv_cache_specs_consistent(
    engine_env, kv_cache_utils, monkeypatch, tmp_path_factory, shape
):
    shape = dict(shape)
    preset, skipped = shape.pop("preset"), shape.pop("skipped")
    num_layers = len(shape["layer_types"])
    hf_config = qwen3_next(
        num_hidden_layers=num_layers,
        hidden_size=shape["num_attention_heads"] * shape["head_dim"],
        **shape,
    )
    vllm_config = hybrid_engine_config(
        hf_config,
        tmp_path_factory.mktemp("model"),
        kv_cache_dtype=preset,
        skip_layers=[str(i) for i in skipped],
    )
    with monkeypatch.context() as patch:
        specs, backends = build_kv_cache_specs(vllm_config, patch)
    attn = [i for i, t in enumerate(shape["layer_types"]) if t == "full_attention"]
    check_kv_cache_specs(
        vllm_config,
        specs,
        backends,
        kv_cache_utils,
        preset,
        tq_layers=[i for i in attn if i not in skipped],
        native_layers=skipped,
    )


# --------------------------------------------------------------------------
# vllm#50709: the V1 runner shapes TurboQuant caches with dtype "auto"
# --------------------------------------------------------------------------

# TurboQuantConfig.from_cache_dtype, reached from the V1 runner's
# _reshape_kv_cache_tensors through the backend's get_kv_cache_shape.
AUTO_DTYPE = r"Unknown TurboQuant cache dtype: 'auto'"


# The attention shape of the small dense and hybrid models.
SMALL_ATTENTION = dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=128, hidden_size=512
)


def small_dense() -> Any:
    """A Llama with 8 layers (TurboQuant on 2..5, boundary layers native)."""
    return hf_config("LlamaConfig", LLAMA_3_8B, num_hidden_layers=8, **SMALL_ATTENTION)


def small_hybrid() -> Any:
    """Qwen3-Next-like: three linear-attention layers, then full attention."""
    return qwen3_next(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        **SMALL_ATTENTION,
    )


@pytest.mark.some_trees  # both model runners: v0.33.0, not v0.34.0
def test_runner_specs_from_model_runner_v2(engine_env, monkeypatch, tmp_path):
    """Where a tree has no V1 GPU model runner (v0.34.0 removed
    ``vllm/v1/worker/gpu_model_runner.py``), the harness takes the layers'
    KV cache specs from model runner V2's ``attn_utils.get_kv_cache_spec``:
    on this tree, which has both, V2's specs are V1's for a hybrid with a
    skip layer."""
    if h.v1_gpu_runner() is None:
        pytest.skip("the tree has model runner V2 alone: nothing to compare")
    make_config, expected = HYBRIDS["qwen3_5_9b"]
    vllm_config = hybrid_engine_config(
        make_config(), tmp_path, skip_layers=[str(expected[0])]
    )
    build_attention_layers(vllm_config, expected, monkeypatch)
    v1 = h.runner_kv_cache_specs(vllm_config)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    assert h.v1_gpu_runner() is None
    assert h.runner_kv_cache_specs(vllm_config) == v1


@pytest.mark.bug_signature(ValueError, AUTO_DTYPE)
@pytest.mark.bug_signature(NotImplementedError, GATE)
@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_runner_shapes_tq_kv_cache(
    engine_env, kv_cache_utils, monkeypatch, tmp_path, model
):
    """The model runner allocates and shapes the KV cache it planned: each
    TurboQuant layer gets a uint8 cache of its packed slots, every layer a
    cache.

    vllm#50709, "Unknown TurboQuant cache dtype: 'auto'" at start-up, reported
    for hybrids on 0.25.0 / 0.26.0: the V1 runner's _reshape_kv_cache_tensors
    passes cache_dtype_str="auto" for every layer whose spec has
    kv_quant_mode NONE (meant for skip layers, v0.25.0), which TurboQuant's
    spec has, and TurboQuantAttentionBackend.get_kv_cache_shape cannot size
    "auto". Not hybrid-specific (the dense case shows it too). From v0.27.0
    TurboQuant specs carry their own quant mode (vllm#50533); from v0.29.0 the
    runner allocates by layout and the backend has no get_kv_cache_shape.
    The hybrid case also fails on v0.20.x, with the gate's signature."""
    preset = "turboquant_k8v4"
    hf_config = small_hybrid() if model == "hybrid" else small_dense()
    vllm_config = engine_config(hf_config, tmp_path, kv_cache_dtype=preset)
    if model == "hybrid":
        specs, backends = build_kv_cache_specs(vllm_config, monkeypatch)
    else:
        specs, backends = build_dense_kv_cache_specs(vllm_config, monkeypatch)
    (kv_cache_config,) = h.kv_cache_configs(vllm_config, [specs], [64 * 2**20])
    kv_caches = h.runner_kv_caches(vllm_config, kv_cache_config, backends)

    assert set(kv_caches) == set(specs)
    model_config = vllm_config.model_config
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    slot = tq_slot_bytes(preset, model_config.get_head_size())
    tq_names = [name for name, spec in specs.items() if h.is_turboquant_spec(spec)]
    assert tq_names
    for name in tq_names:
        cache = kv_caches[name]
        # (blocks, block, heads, slot) or head-major; kernel blocks may split
        # a manager block.
        assert cache.dtype == torch.uint8 and cache.dim() == 4
        assert cache.shape[-1] == slot and num_kv_heads in cache.shape[1:3]
        tokens = cache.shape[0] * cache.shape[1] * cache.shape[2] // num_kv_heads
        assert tokens == kv_cache_config.num_blocks * specs[name].block_size


# --------------------------------------------------------------------------
# The Qwen3.5 stub
# --------------------------------------------------------------------------


def test_qwen3_5_stub_matches_tree(vllm_tree):
    """Qwen3_5ForConditionalGeneration's Mamba-state methods, which size the
    hybrid page, are the same code as Qwen3NextForCausalLM's that the tests
    resolve it to."""
    models = vllm_tree / "vllm" / "model_executor" / "models"

    def methods(module: str, cls: str) -> dict[str, str]:
        tree = ast.parse((models / f"{module}.py").read_text())
        (node,) = [
            n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls
        ]
        return {
            f.name: ast.dump(ast.Module(body=f.body, type_ignores=[]))
            for f in node.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("get_mamba_state")
        }

    qwen3_5 = methods("qwen3_5", "Qwen3_5ForConditionalGeneration")
    assert set(qwen3_5) >= {
        "get_mamba_state_shape_from_config",
        "get_mamba_state_dtype_from_config",
    }
    qwen3_next_methods = methods("qwen3_next", "Qwen3NextForCausalLM")
    for name, body in qwen3_5.items():
        assert qwen3_next_methods[name] == body, name
