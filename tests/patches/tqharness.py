"""Release-portable building blocks for the TurboQuant targeted tests.

The tq tests run against every vLLM release from v0.20.0 on. The code they
test stays put, but what surrounds it moves: the metadata builder and the
impl read a real ``VllmConfig`` (v0.24.0 / v0.28.0), the KV cache turns
head-major behind a transpose (v0.26.0) and loses ``get_kv_cache_shape`` for
a layout enum (v0.29.0), TurboQuant's spec class goes (v0.28.0), fields of
``CommonAttentionMetadata`` go (v0.30.0), planner functions move
(v0.33.0). Each helper here finds what the tree under test has by probing
its API (``hasattr``, ``inspect.signature``, dataclass fields, imports),
never by its version string, and does what that tree's model runner does.

Everything imports vLLM lazily: this module is imported at collection time,
before ``VLLM_TREE`` is on ``sys.path``.

API (used by the tq tests and by the GPU scripts in ci/gpu/, through
ci/gpu/tqlib.py):

``use_tree_env(tree)``
    Make the source tree ``tree`` this process's only vLLM, in the
    environment apply.py gives every test run (before vLLM is imported).
``install_platform(tree, setattr=setattr)``
    vLLM's platform for a source tree (CpuPlatform, or CudaPlatform where
    the tree has its compiled extensions and a GPU is there), installed as
    ``current_platform``; a CPU-only torch gets a no-op ``empty_cache``.
    CpuPlatform stands for CUDA where the tree gates a kernel on CUDA
    (``stand_in_for_cuda``). Every vLLM module already imported is pointed
    at it (``rebind_current_platform``), as in a fresh process.
``write_tiny_model(path, ...)``
    A local HF ``config.json`` (Qwen3 architecture, no weights).
``make_vllm_config(model_dir, preset=..., block_size=..., max_model_len=...)``
    A real ``VllmConfig`` through ``EngineArgs.create_engine_config``.
``inspect_models_in_process(monkeypatch=None)``
    Model-class inspection without vLLM's subprocess (a faster config).
``build_tq_attention(vllm_config, num_heads, head_size, num_kv_heads, index,
backend=None)``
    A real ``Attention`` layer on the TurboQuant backend, or on ``backend``
    (it registers itself in the config's forward context, so build each name
    once per config).
``tq_impl(vllm_config, num_heads, head_size, num_kv_heads, preset, module)``
/ ``centroids_layer(impl, head_size, device)``
    A bare ``TurboQuantAttentionImpl`` (``UltraQuantAttentionImpl`` for the
    UltraQuant preset) built under the config, and the layer state it reads
    (the centroids buffer the engine's layer registers).
``is_ultraquant(preset)`` / ``backend_class(preset)`` / ``backend_modules(preset)``
    UltraQuant (v0.32.0+: ``ultraquant_attn``, a subclass of the TurboQuant
    backend that reuses its builder, metadata and cache layout); the backend
    class of a preset; the modules whose globals (``_HAS_FLASH_ATTN``,
    ``_CONTINUATION_DECODE_THRESHOLD``, ...) its code reads: UltraQuant's
    copies them from TurboQuant's at import, so a test patches both.
``fix_interpreter_bf16_dot(setattr)``
    Triton's interpreter multiplies bf16 ``tl.dot`` operands as their raw
    16-bit patterns; widen them to fp32 first (exact), so that kernels that
    use bf16 dots (UltraQuant's) run right on CPU.
``faster_interpreter()``
    Triton's interpreter patches ``triton.language`` again at every call of
    a jit'd helper inside a kernel; skip the repeat (conftest.py, CPU).
``tq_builder(vllm_config, spec, layer_names, device, module)``
    The metadata builder, as ``initialize_kv_cache`` makes it.
``workspace_bytes()``
    Bytes held by the process's workspace manager (0 without one).
``new_storage_sizes(fn)``
    The sizes of the storages ops create while ``fn`` runs (views excluded):
    what a code path allocates, to bound it.
``ReferenceFlashAttn``
    ``flash_attn_varlen_func``'s contract in float64 PyTorch (varlen, GQA,
    bottom-right causal, LSE), checking the arguments the real kernel would
    misread and recording each call's key length.
``runner_kv_cache_specs(vllm_config)`` / ``runner_kv_cache_spec(layer,
vllm_config)``
    The KV cache specs of the registered layers as the tree's model runner
    makes them (its own ``get_kv_cache_spec``: what the backend adds to a
    layer's spec, e.g. ``indexes_kv_by_block_stride`` or ``customize_spec``,
    comes with it).
``v1_gpu_runner()``
    The tree's V1 ``GPUModelRunner``, or None where only model runner V2 is
    left (v0.34.0+); the two helpers above then use V2's ``attn_utils``.
``is_turboquant_spec(spec)``
    TurboQuant layer spec: ``TQFullAttentionSpec`` (up to v0.27.x) or a spec
    whose ``kv_quant_mode`` is a TurboQuant mode (v0.28.0+).
``tq_config(preset, head_size)`` / ``tq_slot_size(preset, head_size)``
    The tree's ``TurboQuantConfig`` for a preset, and its packed slot bytes
    (UltraQuant's FP4 + UE8M0 slot for its preset).
``soa_pages(impl)`` / ``record_offsets(kv_slots, cfg, soa)``
    Whether ``impl`` stores turboquant_soa's pages (FlyDSL on ROCm;
    tq-v0.33/0011 where the grouped decode runs), not slots; and where each
    byte of a token's slot record (key codes, norm, value codes, value scale,
    zero: the slot layout's bytes of a (token, head)) lies in a page of
    either layout.
``read_records(kv_slots, slots, cfg, soa)`` / ``write_records(kv_slots,
slots, data, cfg, soa)`` / ``as_slots(kv_slots, cfg)`` / ``as_soa(...)``
    The slot records of cache slots, in either layout; a cache of one
    layout copied to the other.
``TQCache`` / ``new_tq_kv_cache(num_blocks, block_size, num_kv_heads,
head_size, preset, generator=..., device=...)`` (generator None: drawn on
the device)
    A KV cache of random bytes laid out as the tree's runner lays it out:
    ``.runner`` is the tensor the runner passes to ``do_kv_cache_update`` and
    ``forward`` (``(nb, bs, Hk, slot)`` up to v0.25.1, the head-major
    ``(nb, Hk, bs, slot)`` view from v0.26.0); ``.slots`` is a
    ``(nb, bs, Hk, slot)`` view of the same storage, the indexing TurboQuant's
    kernels use, for references that read the bytes back.
``common_attn_metadata(**fields)`` / ``cam_replace(cam, **fields)``
    ``CommonAttentionMetadata`` with the fields the tree has; the optional
    CPU mirrors it lacks (``_seq_lens_cpu``, ``_num_computed_tokens_cpu``,
    gone in v0.30.0) are dropped, as that tree's runner cannot pass them.
``cam_has_field(name)``
    Whether the tree's ``CommonAttentionMetadata`` has that field.
``kv_cache_planning()``
    The module with ``get_kv_cache_groups`` / ``get_kv_cache_configs``
    (``kv_cache_planning`` from v0.33.0, ``kv_cache_utils`` before).
``kv_cache_groups(vllm_config, specs)`` / ``kv_cache_configs(vllm_config,
specs_per_worker, memory_per_worker)``
    KV cache grouping and configs as the engine core computes them: the KV
    cache layout resolved first where the tree resolves one (v0.29.0+, from
    the backends of the layers registered in the config), and
    ``get_global_kv_cache_groups``'s result passed along (v0.33.0).
``resolve_kv_cache_layout(vllm_config, specs)``
    That layout step alone (a no-op before v0.29.0 and once resolved).
``full_attention_layer_indices()``
    The tree's finder of a hybrid's full-attention layers
    (``get_full_attention_layer_indices`` with tq/0003,
    ``_get_full_attention_layer_indices`` upstream from v0.21.0), or None.
``mamba_state_layer(shapes, dtypes)``
    A ``MambaBase`` whose state shapes and dtypes are given: its
    ``get_kv_cache_spec`` is the tree's own (properties the base class
    grows, e.g. ``is_kv_cache_tp_replicated`` in v0.29.0, come with it).
``host_ints(x)``
    A metadata host copy (a list, or a CPU tensor upstream) as a list of
    Python ints.
``tree_root()``
    The root of the vLLM tree under test.
``runner_kv_caches(vllm_config, kv_cache_config, backends)``
    The per-layer KV cache tensors the tree's model runner allocates and
    shapes for a KV cache config (on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Products an MMA step of the tensor cores sums (sm80/sm90 fp16, k = 16).
MMA_K_STEP = 16
TQ_MODULE = "vllm.v1.attention.backends.turboquant_attn"
UQ_MODULE = "vllm.v1.attention.backends.ultraquant_attn"
UQ_PRESET = "ultraquant_4bit"


# --------------------------------------------------------------------------
# Platform, config and layers, as the engine makes them
# --------------------------------------------------------------------------


def use_tree_env(tree: Path) -> None:
    """Make the source tree ``tree`` this process's (and its subprocesses')
    only vLLM, in the environment apply.py gives every test run
    (``applylib/testrun.tree_env``: the tree and a minimal package metadata
    for it lead the path, so vLLM finds its version, which platform
    detection and from v0.23.0 its Triton check read; private vLLM, Triton
    and torch.compile caches). Call it before anything imports vLLM."""
    import atexit
    import os
    import shutil
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from applylib.testrun import tree_env

    scratch = Path(tempfile.mkdtemp(prefix="vllm-tree-"))
    atexit.register(shutil.rmtree, scratch, True)
    os.environ.update(tree_env(Path(tree), scratch))
    sys.path[0:0] = os.environ["PYTHONPATH"].split(os.pathsep)[:2]


# torch.cpu's probes of the host's CPU features that CpuPlatform reads.
CPU_FEATURE_PROBES = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


GROUPED_DECODE = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


def stand_in_for_cuda(tree: Path, setattr: Any) -> None:
    """Where the tree decides by platform what runs on CUDA alone, the stand-in
    platform answers as CUDA: the grouped TurboQuant decode
    (``_measured_platform``; the real one is its ``__wrapped__``)."""
    if not (Path(tree) / (GROUPED_DECODE.replace(".", "/") + ".py")).is_file():
        return
    gd = importlib.import_module(GROUPED_DECODE)
    real = getattr(gd, "_measured_platform", None)
    if real is not None and not hasattr(real, "__wrapped__"):

        def on_cuda() -> bool:
            return True

        on_cuda.__wrapped__ = real  # type: ignore[attr-defined]
        setattr(gd, "_measured_platform", on_cuda)


def real(func: Any) -> Any:
    """The function a stand-in replaced (``stand_in_for_cuda``), or ``func``."""
    return getattr(func, "__wrapped__", func)


def rebind_current_platform(new: Any, setattr: Any) -> None:
    """Point every vLLM module's ``current_platform`` (``from vllm.platforms
    import current_platform``, bound when the module is first imported,
    maybe under an earlier test's platform) at ``new``, as in a fresh
    process. Without it, state an earlier test left on its platform reached
    the next: on v0.34.0 a hybrid's KV cache plan after UltraQuant's tests
    failed with "Failed to promote local KV cache specs"."""
    for name, module in list(sys.modules.items()):
        held = getattr(module, "__dict__", {}).get("current_platform")
        if name.startswith("vllm") and held is not None and held is not new:
            setattr(module, "current_platform", new)


def install_platform(tree: Path, setattr: Any = setattr) -> Any:
    """Install vLLM's platform for the source tree ``tree`` as
    ``current_platform`` (an uninstalled tree detects none: detection reads
    the installed package's metadata). CudaPlatform needs vLLM's compiled
    extensions (``vllm/_C*.so``, ``vllm_flash_attn``): a plain source tree
    runs on CpuPlatform, its tensors and Triton kernels on the GPU all the
    same. ``setattr`` may be a ``monkeypatch.setattr``, to undo it.

    CpuPlatform, standing in, configures by the host's CPU features: with
    AVX-512 BF16 it stores a Mamba SSM state in float32 instead of the
    model's dtype (doubling the Mamba page: another hybrid page plan), with
    AMX it picks other MLA backends. A GPU deployment takes none of those
    branches, and an outcome must not depend on the machine: the stand-in
    sees a CPU without them."""
    from vllm import platforms

    if torch.cuda.is_available() and any((Path(tree) / "vllm").glob("_C*.so")):
        from vllm.platforms.cuda import CudaPlatform as Platform
    else:
        from vllm.platforms.cpu import CpuPlatform as Platform  # type: ignore

        for probe in CPU_FEATURE_PROBES:
            if hasattr(torch.cpu, probe):
                setattr(torch.cpu, probe, lambda: False)
    platform = Platform()
    setattr(platforms, "_current_platform", platform)
    rebind_current_platform(platform, setattr)
    if Platform.__name__ == "CpuPlatform":
        stand_in_for_cuda(tree, setattr)
    if torch.accelerator.current_accelerator() is None:
        # WorkspaceManager empties the accelerator's cache when it grows.
        setattr(torch.accelerator, "empty_cache", lambda: None)
    return platform


def decode_params(layer: Any, impl: Any) -> dict[str, Any]:
    """The TurboQuant decode launchers' arguments that come from the layer
    and its config (v0.33.0's kernel and the grouped one take the same)."""
    cfg = impl.tq_config
    return {
        "centroids": layer._tq_centroids,
        "scale": impl.scale,
        "mse_bits": cfg.key_mse_bits,
        "key_packed_size": cfg.key_packed_size,
        "value_quant_bits": cfg.effective_value_quant_bits,
        "key_fp8": cfg.key_fp8,
        "norm_correction": cfg.norm_correction,
        "PiT": layer._tq_PiT,
    }


def write_tiny_model(
    path: Path,
    *,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 128,
    num_layers: int = 8,
    max_position_embeddings: int = 1 << 20,
    dtype: str = "float16",
) -> Path:
    """A local Qwen3 ``config.json`` (no weights): enough for EngineArgs."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": num_heads * head_dim,
        "intermediate_size": 2 * num_heads * head_dim,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": 1024,
        "torch_dtype": dtype,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def inspect_models_in_process(monkeypatch: Any = None) -> None:
    """vLLM inspects model classes in a fresh ``python -m vllm...``
    subprocess (to keep CUDA uninitialised in the parent); a test or script
    process can do it in-process, which saves a second vLLM import (and a
    subprocess that must find the same tree)."""
    from vllm.model_executor.models import registry

    (monkeypatch.setattr if monkeypatch else setattr)(
        registry, "_run_in_subprocess", lambda fn: fn()
    )


def make_vllm_config(
    model_dir: Path,
    *,
    preset: str,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    max_num_seqs: int = 8,
    dtype: torch.dtype = torch.float16,
    kv_splits: int | None = 2,
    **engine_args: Any,
) -> Any:
    """A real VllmConfig for the model in ``model_dir`` (platform installed
    by the caller). ``kv_splits`` keeps the decode kernel cheap in Triton's
    interpreter (None: the tree's default)."""
    from vllm.engine.arg_utils import EngineArgs

    if kv_splits is not None:
        engine_args.setdefault(
            "attention_config", {"tq_max_kv_splits_for_cuda_graph": kv_splits}
        )
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float16" if dtype == torch.float16 else "bfloat16",
        kv_cache_dtype=preset,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_seqs=max_num_seqs,
        **engine_args,
    )
    return args.create_engine_config()


def build_tq_attention(
    vllm_config: Any,
    num_heads: int,
    head_size: int,
    num_kv_heads: int,
    index: int | None = None,
    backend: Any = None,
) -> Any:
    """``model.layers.{index}.self_attn.attn`` on the TurboQuant backend; by
    default the first layer that boundary protection leaves to TurboQuant
    (dense models keep their first and last layers in the model dtype)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    backend = backend or importlib.import_module(TQ_MODULE).TurboQuantAttentionBackend
    if index is None:
        skipped = {int(i) for i in vllm_config.cache_config.kv_cache_dtype_skip_layers}
        index = min(set(range(len(skipped) + 1)) - skipped)
    with set_current_vllm_config(vllm_config):
        return Attention(
            num_heads,
            head_size,
            head_size**-0.5,
            num_kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"model.layers.{index}.self_attn.attn",
            attn_backend=backend,
        )


def v1_gpu_runner() -> Any:
    """The tree's V1 ``GPUModelRunner``, or None where the tree has only
    model runner V2 (``vllm/v1/worker/gpu/``, v0.34.0+)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ModuleNotFoundError as e:
        if e.name != "vllm.v1.worker.gpu_model_runner":
            raise
        return None
    return GPUModelRunner


def runner_kv_cache_specs(vllm_config: Any) -> dict[str, Any]:
    """The KV cache specs the tree's GPU model runner makes of the layers
    registered in ``vllm_config`` (V1: ``GPUModelRunner.get_kv_cache_spec``,
    called on a runner object holding only what it reads; V2 alone, v0.34.0+:
    ``attn_utils.get_kv_cache_spec``): each layer's own spec plus what the
    runner adds, e.g. ``indexes_kv_by_block_stride`` from the backend
    (v0.24.0-v0.28.0) or the backend's ``customize_spec`` (v0.28.0+)."""
    GPUModelRunner = v1_gpu_runner()
    if GPUModelRunner is None:
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

        return get_kv_cache_spec(vllm_config)
    runner = object.__new__(GPUModelRunner)
    runner.__dict__.update(vllm_config=vllm_config, shared_kv_cache_layers={})
    return GPUModelRunner.get_kv_cache_spec(runner)


def runner_kv_cache_spec(layer: Any, vllm_config: Any) -> Any:
    """One registered layer's spec, as the model runner makes it."""
    return runner_kv_cache_specs(vllm_config)[layer.layer_name]


def tq_module() -> Any:
    import importlib

    return importlib.import_module(TQ_MODULE)


def shrink_continuation_tile(tq: Any, tokens: int, setattr: Any) -> None:
    """Walk a continuation's cached context in tiles of ``tokens``: the
    tile's bounds (tq/0001's and tq-v0.33/0001's constants) as the builder
    and the impl read them when built. On a tree without them the names are
    set unused, so a test runs there as well."""
    setattr(tq, "_CONTINUATION_TILE_MIN", tokens, raising=False)
    setattr(tq, "_CONTINUATION_TILE_MAX", tokens, raising=False)


def is_ultraquant(preset: str) -> bool:
    return preset == UQ_PRESET


def backend_modules(preset: str) -> tuple[Any, ...]:
    """The modules whose globals the preset's attention code reads."""
    import importlib

    if is_ultraquant(preset):
        return tq_module(), importlib.import_module(UQ_MODULE)
    return (tq_module(),)


def backend_class(preset: str) -> Any:
    module = backend_modules(preset)[-1]
    if is_ultraquant(preset):
        return module.UltraQuantAttentionBackend
    return module.TurboQuantAttentionBackend


def fix_interpreter_bf16_dot(setattr: Any = setattr) -> None:
    """Triton's interpreter (3.9) stores bf16 as uint16 and multiplies
    ``tl.dot`` operands as they are stored: a bf16 dot returns products of
    bit patterns. Widen bf16 operands to fp32 first (exact: bf16 is fp32's
    upper half). Only for the interpreter; a no-op without Triton."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot
    if getattr(create_dot, "widens_bf16", False):
        return

    def widen(x: Any) -> Any:
        if x.dtype != tl.bfloat16:
            return x
        bits = x.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot_widened(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        return create_dot(self, widen(a), widen(b), d, *args)

    create_dot_widened.widens_bf16 = True  # type: ignore[attr-defined]
    setattr(builder, "create_dot", create_dot_widened)


# fp8 formats of Triton and torch: (torch dtype, largest finite value).
FP8 = {"fp8e4nv": (torch.float8_e4m3fn, 448.0), "fp8e5": (torch.float8_e5m2, 57344.0)}


def fp8_bits(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` cast to ``fmt`` as a GPU's Triton kernel casts it (round to
    nearest even, out-of-range values saturated to the largest finite one:
    PTX ``cvt.rn.satfinite``), as bytes."""
    dtype, top = FP8[fmt]
    return x.float().clamp(-top, top).to(dtype).view(torch.uint8)


def exact_fp8_casts(setattr: Any = setattr) -> list[int]:
    """Triton's interpreter (3.9) casts to fp8 by truncating the significand
    and adding the cut-off bit, which loses the carry into the exponent and
    rounds ties up: 0.123 -> 0.0625 (a GPU: 0.125), 100 -> 104 (96). Casts
    from fp32, fp16 and bf16 to ``FP8``'s formats go through ``fp8_bits``
    instead (checked bit for bit against an H100: ci/gpu/fp8_cast_check.py).
    Returns a list that grows by the elements of each replaced cast. Only
    for the interpreter."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    used: list[int] = []
    wide = {tl.float32: np.float32, tl.float16: np.float16, tl.bfloat16: None}

    def convert_exact(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if dst.name not in FP8 or src not in wide:
            return convert(data, src, dst, rounding_mode)
        used.append(data.size)
        if src == tl.bfloat16:  # stored as uint16, fp32's upper half
            data = (np.asarray(data).astype(np.uint32) << 16).view(np.float32)
        x = torch.from_numpy(np.asarray(data, dtype=wide[src] or np.float32))
        return fp8_bits(x, dst.name).numpy().reshape(np.shape(data))

    setattr(interpreter, "_convert_float", convert_exact)
    return used


def faster_interpreter() -> None:
    """Triton's interpreter (3.9) patches ``triton.language`` for every
    launch (restored after it) and again at every call of a ``@triton.jit``
    helper from a kernel, once per program instance, each time walking the
    language modules with ``inspect.getmembers``; and it builds its dtype
    table at every use. About a third of a TurboQuant test's time on CPU.
    Inside a launch that patched the helper's language modules already (the
    launch itself, or an earlier helper call, whose patches Triton never
    restores) its calls skip the repeat, and the dtypes are built once: the
    patched language and the numbers are the same. Only for the
    interpreter; idempotent."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch = interpreter._patch_lang
    if getattr(patch, "skips_nested", False):
        return
    launches: list[frozenset[int] | None] = []  # None: launch not patched yet

    @functools.cache
    def lang_modules(fn: Any) -> frozenset[int]:
        return frozenset(
            id(v) for v in fn.__globals__.values() if v is tl or v is tl.core
        )

    def patch_lang(fn: Any) -> Any:
        mods = lang_modules(fn)
        done = launches[-1] if launches else None
        if done is not None and mods <= done:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = patch(fn)  # Triton drops a helper's scope: its patches hold
        if launches:
            launches[-1] = mods | (done or frozenset())
        return scope

    launch = interpreter.GridExecutor.__call__

    def launch_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    np_dtype = interpreter._get_np_dtype
    scalar_np_dtype = functools.cache(np_dtype)  # pointer types: unhashable

    def get_np_dtype(ty: Any) -> Any:
        ty = ty.element_ty if isinstance(ty, tl.block_type) else ty
        return np_dtype(ty) if isinstance(ty, tl.pointer_type) else scalar_np_dtype(ty)

    patch_lang.skips_nested = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch_tracked
    interpreter._get_np_dtype = get_np_dtype


def mma_truncating(
    a: Any, b: Any, acc: Any, k_step: int = MMA_K_STEP, guard_bits: int = 2
) -> Any:
    """``a @ b + acc`` (numpy; fp16 operands, fp32 ``acc``) as an NVIDIA
    tensor core sums it, one MMA per ``k_step`` products: the products
    (exact) and the fp32 accumulator aligned to the largest exponent among
    them, each truncated toward zero to 24 + ``guard_bits`` bits there,
    summed, and the sum truncated to fp32. A one-signed sum carried in one
    accumulator loses about 2**-25 of itself an MMA, where numpy's fp32
    rounds to nearest. Bit-equal to an H200's ``tl.dot`` in 93-100% of
    outputs (ci/gpu/tc_rounding_check.py)."""
    import numpy as np

    out = acc.astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for k in range(0, a64.shape[-1], k_step):
        terms = a64[..., :, k : k + k_step, None] * b64[..., None, k : k + k_step, :]
        terms = np.concatenate([terms, out[..., :, None, :]], axis=-2)
        top = np.abs(terms).max(axis=-2, keepdims=True)
        _, exp = np.frexp(np.where(top > 0, top, 1.0))
        quantum = np.ldexp(1.0, exp - 24 - guard_bits)
        exact = (np.trunc(terms / quantum) * quantum).sum(axis=-2)
        out = exact.astype(np.float32)
        over = np.abs(out.astype(np.float64)) > np.abs(exact)
        out = np.where(over, np.nextafter(out, np.float32(0)), out)
    return out


def tensor_core_dots(setattr: Any = setattr) -> None:
    """Triton's interpreter computes ``tl.dot`` in numpy fp32, rounding to
    nearest; make its fp16 dots into an fp32 accumulator round as the
    tensor cores do (``mma_truncating``). The error of an accumulation that
    a GPU truncates shows on CPU. Only for the interpreter."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def create_dot_truncating(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if not (a.dtype == b.dtype == tl.float16 and d.dtype == tl.float32):
            return create_dot(self, a, b, d, *args)
        out = mma_truncating(a.data, b.data, d.data)
        return interpreter.TensorHandle(out, tl.float32)

    setattr(builder, "create_dot", create_dot_truncating)


def tq_impl(
    vllm_config: Any,
    num_heads: int,
    head_size: int,
    num_kv_heads: int,
    preset: str,
    module: Any = None,
) -> Any:
    """A bare ``TurboQuantAttentionImpl`` (``UltraQuantAttentionImpl`` for
    the UltraQuant preset; of ``module``, default the tree's backend), built
    under ``vllm_config`` as the layer builds it."""
    from vllm.config import set_current_vllm_config

    module = module or backend_modules(preset)[-1]
    name = "UltraQuant" if is_ultraquant(preset) else "TurboQuant"
    with set_current_vllm_config(vllm_config):
        return getattr(module, f"{name}AttentionImpl")(
            num_heads=num_heads,
            head_size=head_size,
            scale=head_size**-0.5,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=preset,
        )


def centroids_layer(impl: Any, head_size: int, device: torch.device) -> Any:
    """The layer state a bare impl reads: the engine's Attention layer
    registers the TurboQuant centroids as a buffer, on the layer's device."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    layer = torch.nn.Module()
    centroids = get_centroids(head_size, impl.tq_config.centroid_bits)
    layer.register_buffer("_tq_centroids", centroids.to(device))
    return layer


def tq_builder(
    vllm_config: Any,
    spec: Any,
    layer_names: list[str],
    device: torch.device,
    module: Any = None,
) -> Any:
    """The metadata builder, as ``initialize_kv_cache`` makes it from the
    layers' KV cache spec (later trees reserve workspace here)."""
    builder_cls = (module or tq_module()).TurboQuantMetadataBuilder
    return builder_cls(spec, layer_names, vllm_config, device)


def workspace_bytes() -> int:
    """Bytes held by the process's workspace manager (0 without one)."""
    from vllm.v1.worker import workspace

    if not workspace.is_workspace_manager_initialized():
        return 0
    ws = workspace.current_workspace_manager()._current_workspaces[0]
    return 0 if ws is None else ws.numel() * ws.element_size()


def new_storage_sizes(fn: Any) -> set[int]:
    """The sizes of every storage any op creates while fn runs (views of
    existing storage excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    sizes: set[int] = set()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in seen:
                        sizes.add(storage.nbytes())
            return out

    with Spy():
        fn()
    return sizes


def is_turboquant_spec(spec: Any) -> bool:
    import vllm.v1.kv_cache_interface as kvi

    tq_spec_cls = getattr(kvi, "TQFullAttentionSpec", None)
    if tq_spec_cls is not None and isinstance(spec, tq_spec_cls):
        return True
    mode = getattr(spec, "kv_quant_mode", None)
    return bool(getattr(mode, "is_turboquant", False))


def tq_config(preset: str, head_size: int) -> Any:
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    return TurboQuantConfig.from_cache_dtype(preset, head_size)


def tq_slot_size(preset: str, head_size: int) -> int:
    if is_ultraquant(preset):
        from vllm.v1.attention.ops.ultraquant.format import slot_size

        return slot_size(head_size)
    return tq_config(preset, head_size).slot_size_aligned


# --------------------------------------------------------------------------
# KV cache tensors
# --------------------------------------------------------------------------


def soa_pages(impl: Any) -> bool:
    """Whether ``impl`` stores turboquant_soa's pages, not slots (FlyDSL on
    ROCm; tq-v0.33/0011: where the grouped decode runs)."""
    return bool(getattr(impl, "_soa_store", False))


def record_offsets(kv_slots: torch.Tensor, cfg: Any, soa: bool) -> torch.Tensor:
    """(block, hk, slot): the page offset of each byte of a token's slot
    record (key codes, norm, value codes, value scale, zero). Slots: where
    the cache's strides put it. turboquant_soa: rows [block, hk, key codes +
    value codes], then fp16 arrays [hk, field, block] (norm for MSE keys,
    value scale, value zero), the slots' padding after them."""
    block, hk, width = kv_slots.shape[1:]
    pos = torch.arange(block).view(-1, 1, 1)
    head = torch.arange(hk).view(1, -1, 1)
    if not soa:
        _, s_pos, s_head, _ = kv_slots.stride()
        return pos * s_pos + head * s_head + torch.arange(width)
    d, kps = cfg.head_dim, cfg.key_packed_size
    kb = d if cfg.key_fp8 else math.ceil(d * cfg.key_mse_bits / 8)
    vb = math.ceil(d * cfg.effective_value_quant_bits / 8)
    fields = ([] if cfg.key_fp8 else [kb]) + [kps + vb, kps + vb + 2]
    used, row, two = kps + vb + 4, kb + vb, torch.arange(2)
    out = torch.empty(block, hk, width, dtype=torch.int64)
    rows = (pos * hk + head) * row
    out[..., :kb] = rows + torch.arange(kb)
    out[..., kps : kps + vb] = rows + kb + torch.arange(vb)
    for f, at in enumerate(fields):
        arrays = block * hk * row + 2 * ((head * len(fields) + f) * block + pos)
        out[..., at : at + 2] = arrays + two
    pad = block * hk * used + (pos * hk + head) * (width - used)
    out[..., used:] = pad + torch.arange(width - used)
    return out


def _pages(kv_slots: torch.Tensor) -> torch.Tensor:
    """(blocks, page bytes): each page's bytes, one contiguous run."""
    nb, block, hk, width = kv_slots.shape
    return kv_slots.as_strided((nb, block * hk * width), (kv_slots.stride(0), 1))


def _record_index(kv_slots, slots, cfg, soa) -> tuple[torch.Tensor, torch.Tensor]:
    block = kv_slots.shape[1]
    slots = slots.to(kv_slots.device).long()
    offs = record_offsets(kv_slots, cfg, soa).to(kv_slots.device)
    return (slots // block).view(-1, 1, 1), offs[slots % block]


def read_records(
    kv_slots: torch.Tensor, slots: torch.Tensor, cfg: Any, soa: bool
) -> torch.Tensor:
    """(n, hk, slot) uint8 on the CPU: the slot records of cache ``slots``."""
    blocks, offs = _record_index(kv_slots, slots, cfg, soa)
    return _pages(kv_slots)[blocks, offs].cpu()


def write_records(
    kv_slots: torch.Tensor, slots: torch.Tensor, data: torch.Tensor, cfg, soa
) -> None:
    """Cache ``slots`` given the slot records ``data`` (n, hk, slot)."""
    blocks, offs = _record_index(kv_slots, slots, cfg, soa)
    _pages(kv_slots)[blocks, offs] = data.to(kv_slots.device)


def as_slots(kv_slots: torch.Tensor, cfg: Any) -> torch.Tensor:
    """A copy of a cache of turboquant_soa's pages as slots (for v0.33.0's
    kernels, which read slots only)."""
    nb, block, hk, width = kv_slots.shape
    offs = record_offsets(kv_slots, cfg, True).to(kv_slots.device).view(-1)
    return _pages(kv_slots)[:, offs].view(nb, block, hk, width)


def as_soa(kv_slots: torch.Tensor, cfg: Any) -> torch.Tensor:
    """A copy of a cache of slots as turboquant_soa's pages (same shape)."""
    out = torch.empty_like(kv_slots)
    offs = record_offsets(kv_slots, cfg, True).to(kv_slots.device).view(-1)
    src = record_offsets(kv_slots, cfg, False).to(kv_slots.device).view(-1)
    _pages(out)[:, offs] = _pages(kv_slots)[:, src]
    return out


@dataclass
class TQCache:
    runner: torch.Tensor  # what the runner hands to the attention layer
    slots: torch.Tensor  # (num_blocks, block_size, num_kv_heads, slot): same bytes


def _runner_layout(backend: Any, head_size: int, preset: str) -> tuple[bool, tuple]:
    """(head-major?, physical order of the logical dims) of the tree's
    TurboQuant cache. Logical: (nb, bs, Hk, slot) token-major, or
    (nb, Hk, bs, slot) head-major."""
    if hasattr(backend, "get_kv_cache_shape"):
        # Distinct sizes tell the dims apart.
        shape = backend.get_kv_cache_shape(2, 16, 3, head_size, preset)
        head_major = tuple(shape[1:3]) == (3, 16)
        order: tuple = (0, 1, 2, 3)
        try:
            stride_order = backend.get_kv_cache_stride_order()
            if len(stride_order) == 4:
                order = tuple(stride_order)
        except (AttributeError, NotImplementedError):
            pass
        return head_major, order
    # v0.29.0+: the logical per-layer view is (B, H, N, C); the backend names
    # the physical layouts it reads, the runner allocates the first.
    (layout, *_) = backend.supported_kv_cache_layouts()
    return True, tuple(layout.layer_view_order)


def new_tq_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    preset: str,
    *,
    generator: torch.Generator | None,
    device: torch.device,
) -> TQCache:
    """A TurboQuant KV cache of random bytes (a slot nobody wrote reads as
    garbage), allocated as the tree's runner allocates it. ``generator``
    None: drawn on the device (GPU caches of many GiB)."""
    import importlib

    backend = importlib.import_module(TQ_MODULE).TurboQuantAttentionBackend
    slot = tq_slot_size(preset, head_size)
    head_major, order = _runner_layout(backend, head_size, preset)
    logical = (
        (num_blocks, num_kv_heads, block_size, slot)
        if head_major
        else (num_blocks, block_size, num_kv_heads, slot)
    )
    physical_shape = [logical[i] for i in order]
    if generator is None:
        physical = torch.empty(physical_shape, dtype=torch.uint8, device=device)
        physical.random_(0, 256)
    else:
        physical = torch.randint(
            0, 256, physical_shape, dtype=torch.uint8, generator=generator
        ).to(device)
    inverse = [order.index(i) for i in range(4)]
    runner = physical.permute(*inverse)
    assert tuple(runner.shape) == logical
    slots = runner.transpose(1, 2) if head_major else runner
    return TQCache(runner=runner, slots=slots)


# --------------------------------------------------------------------------
# CommonAttentionMetadata
# --------------------------------------------------------------------------


def _cam_cls() -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata


def cam_has_field(name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(_cam_cls())}


def _known(fields: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(_cam_cls())}
    return {k: v for k, v in fields.items() if k in names}


def common_attn_metadata(**fields: Any) -> Any:
    return _cam_cls()(**_known(fields))


def cam_replace(cam: Any, **fields: Any) -> Any:
    return cam.replace(**_known(fields))


def tree_root() -> Path:
    """The root of the vLLM tree under test (the directory holding vllm/)."""
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def host_ints(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        assert values.device.type == "cpu", f"host copy on {values.device}"
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


# --------------------------------------------------------------------------
# KV cache planning (hybrid models)
# --------------------------------------------------------------------------


def kv_cache_planning() -> Any:
    try:
        import vllm.v1.core.kv_cache_planning as planning
    except ImportError:
        import vllm.v1.core.kv_cache_utils as planning
    return planning


def resolve_kv_cache_layout(vllm_config: Any, specs: list[Any]) -> None:
    """From v0.29.0 the engine core resolves one KV cache layout for the
    model (from what the layers' backends support) before planning, and the
    planner reads it; earlier trees have no such step."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backends,
        )
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
        )
        from vllm.v1.attention.backends.utils import (
            resolve_kv_cache_layout as resolve,
        )
    except ImportError:
        return
    if getattr(vllm_config.cache_config, "kv_cache_layout", None) is not None:
        return
    backends = get_current_attn_backends(vllm_config)
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve(vllm_config, [names], specs)


def kv_cache_groups(vllm_config: Any, specs: dict[str, Any]) -> list[Any]:
    resolve_kv_cache_layout(vllm_config, list(specs.values()))
    return kv_cache_planning().get_kv_cache_groups(vllm_config, specs)


def kv_cache_configs(
    vllm_config: Any, specs_per_worker: list[dict[str, Any]], memory: list[int]
) -> list[Any]:
    resolve_kv_cache_layout(
        vllm_config, [s for specs in specs_per_worker for s in specs.values()]
    )
    planning = kv_cache_planning()
    params = inspect.signature(planning.get_kv_cache_configs).parameters
    if "global_kv_cache_groups" in params:
        groups = planning.get_global_kv_cache_groups(vllm_config, specs_per_worker)
        return planning.get_kv_cache_configs(
            vllm_config, specs_per_worker, memory, groups
        )
    return planning.get_kv_cache_configs(vllm_config, specs_per_worker, memory)


def full_attention_layer_indices() -> Any:
    import vllm.model_executor.layers.quantization.turboquant.config as tq_cfg

    for name in (
        "get_full_attention_layer_indices",
        "_get_full_attention_layer_indices",
    ):
        fn = getattr(tq_cfg, name, None)
        if fn is not None:
            return fn
    return None


def mamba_state_layer(shapes: Any, dtypes: Any, mamba_type: str = "mamba") -> Any:
    """A MambaBase with the given state shapes and dtypes and nothing else
    (building a real GDN / Mamba layer would allocate its weights)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    def unused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    namespace: dict[str, Any] = {
        "get_state_shape": lambda self: shapes,
        "get_state_dtype": lambda self: dtypes,
        "mamba_type": property(lambda self: mamba_type),
    }
    remaining = set(getattr(MambaBase, "__abstractmethods__", ())) - set(namespace)
    namespace.update({name: unused for name in remaining})
    cls = type("StateOnlyMamba", (MambaBase,), namespace)
    layer = object.__new__(cls)
    if isinstance(layer, torch.nn.Module):
        torch.nn.Module.__init__(layer)
    return layer


def runner_kv_caches(
    vllm_config: Any, kv_cache_config: Any, backends: dict[str, Any]
) -> dict[str, Any]:
    """Allocate and shape the KV cache of ``kv_cache_config`` with the
    tree's model-runner code: the V1 runner's ``_allocate_kv_cache_tensors``
    and ``_reshape_kv_cache_tensors`` (up to v0.28.0; called on a runner
    object holding only the attributes they read), or the
    ``allocate_kv_cache`` that replaced them (v0.29.0+). ``backends`` maps
    attention layer names to their backend; kernel block sizes come from the
    tree's ``prepare_kernel_block_sizes``, as in ``initialize_kv_cache``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    GPUModelRunner = v1_gpu_runner()

    group_fields = {f.name for f in dataclasses.fields(AttentionGroup)}
    attn_groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        # As the runner's initialize_attn_backend: one attention group per
        # (backend, layer spec) of the KV cache group (a dense model's one
        # group holds TurboQuant and skipped layers' specs side by side).
        by_key: dict[tuple[Any, Any], list[str]] = {}
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs
                spec = spec.kv_cache_specs[name]
            by_key.setdefault((backends.get(name), spec), []).append(name)
        attn_groups.append(
            [
                AttentionGroup(
                    **{
                        k: v
                        for k, v in {
                            "backend": backend,
                            "layer_names": names,
                            "kv_cache_spec": spec,
                            "kv_cache_group_id": gid,
                        }.items()
                        if k in group_fields
                    }
                )
                for (backend, spec), names in by_key.items()
            ]
        )
    device = torch.device("cpu")
    # The worker wrapper runs initialize_from_config under the config.
    with set_current_vllm_config(vllm_config):
        kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
        if hasattr(GPUModelRunner, "_reshape_kv_cache_tensors"):
            runner = object.__new__(GPUModelRunner)
            runner.__dict__.update(
                device=device,
                vllm_config=vllm_config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                kv_cache_config=kv_cache_config,
                attn_groups=attn_groups,
                runner_only_attn_layers=set(),
            )
            raw = runner._allocate_kv_cache_tensors(kv_cache_config)
            return runner._reshape_kv_cache_tensors(raw, kernel_block_sizes)
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        return allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)


# --------------------------------------------------------------------------
# flash-attn where vLLM's compiled kernel is absent: a float64 reference
# --------------------------------------------------------------------------


def check_cu_seqlens(q, k, cu_q, cu_k, max_q: int, max_k: int) -> None:
    """What the real kernel assumes and would misread silently: int32
    cu_seqlens on q's device, starting at 0, non-decreasing, within the
    q/k tensors, every segment within max_seqlen."""
    for name, cu, t, most in (("q", cu_q, q, max_q), ("k", cu_k, k, max_k)):
        assert cu.dtype == torch.int32, f"cu_seqlens_{name} is {cu.dtype}"
        assert cu.device == q.device, f"cu_seqlens_{name} on {cu.device}"
        assert cu.dim() == 1 and cu.numel() >= 2, f"cu_seqlens_{name} {cu.shape}"
        c = cu.tolist()
        lens = [b - a for a, b in itertools.pairwise(c)]
        assert c[0] == 0 and min(lens) >= 0, f"cu_seqlens_{name} {c}"
        assert c[-1] <= t.shape[0], f"cu_seqlens_{name} {c} beyond {t.shape[0]}"
        assert max(lens) <= most, f"cu_seqlens_{name} {c}: max_seqlen {most}"
    assert cu_q.numel() == cu_k.numel(), "cu_seqlens_q/k batch sizes differ"


class ReferenceFlashAttn:
    """``flash_attn_varlen_func`` in float64 PyTorch: varlen, GQA,
    bottom-right causal, the (Hq, total_q) log-sum-exp when asked for it.

    ``attend`` checks the arguments as the kernel needs them
    (``check_cu_seqlens``) and records every call's key length in
    ``k_lens``. It reads cu_seqlens on the host: it stands for a kernel,
    which reads them on the device. A subclass may attend otherwise; the
    call's plumbing (``out``, what is returned) stays here.
    """

    def __init__(self) -> None:
        self.k_lens: list[int] = []

    def __call__(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=None,
        causal=False,
        return_softmax_lse=False,
        return_attn_probs=False,
        fa_version=None,
        out=None,
        **kwargs: Any,
    ):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        o, lse = self.attend(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
            causal,
        )  # fmt: skip
        if out is not None:
            out.copy_(o)
            o = out
        if return_softmax_lse:
            return o, lse
        if return_attn_probs:
            return o, lse, None
        return o

    def attend(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, causal):
        """(out, lse) of every sequence of the batch."""
        check_cu_seqlens(q, k, cu_q, cu_k, max_q, max_k)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        total_q, num_heads, _ = q.shape
        group = num_heads // k.shape[1]
        o = torch.empty_like(q)
        lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)
        for b in range(len(cq) - 1):
            qb = q[cq[b] : cq[b + 1]].double()
            kb = k[ck[b] : ck[b + 1]].double().repeat_interleave(group, dim=1)
            vb = v[ck[b] : ck[b + 1]].double().repeat_interleave(group, dim=1)
            lq, lk = qb.shape[0], kb.shape[0]
            self.k_lens.append(lk)
            s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
            if causal:
                qp = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
                s = s.masked_fill(torch.arange(lk, device=q.device) > qp, -math.inf)
            lse_b = torch.logsumexp(s, dim=-1)
            o[cq[b] : cq[b + 1]] = torch.einsum(
                "hqk,khd->qhd", torch.exp(s - lse_b.unsqueeze(-1)), vb
            ).to(q.dtype)
            lse[:, cq[b] : cq[b + 1]] = lse_b.float()
        return o, lse
