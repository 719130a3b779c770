"""Targeted tests of tq/0001: TurboQuant continuation prefill in a workspace
reserved before lock, bounded by a tile.

vllm#41726: a chunked-prefill continuation of more than 128 tokens crashes
once the shared workspace is locked ("Workspace is locked but allocation from
'turboquant_attn.py:...:_continuation_prefill' requires 16.00 MB"); on the
v0.20.2 base the same path keeps per-layer dequant buffers that grow with the
context (vllm PR 40941: 57 GB extra at 1M context).

The TurboQuant cache is filled with fresh random, valid bytes (random key
indices / fp8 keys, random norms, value codes, scales and zero points); the
reference is an independent float64 decoder of that format and float64
attention over it. Each chunk's own K/V are passed to ``forward()`` as the
dequantized values of their slots, so every path (first chunk, decode
kernel, tiled continuation) must agree with the same reference.

On CPU the Triton kernels run in Triton's interpreter (see conftest.py), so
shapes are small and the continuation tile is shrunk (its bounds are module
constants of the patched backend) to walk several tiles. With CUDA the same
tests run with larger shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import tqharness as h
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

HAS_CUDA = torch.cuda.is_available()

PRESETS = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
TQ_MODULE = "vllm.v1.attention.backends.turboquant_attn"
# Layers 0, 1 and the last two skip TurboQuant (boundary protection).
NUM_MODEL_LAYERS = 8
FIRST_TQ_LAYER = 2
# A continuation above this many tokens takes the dequant path.
DECODE_THRESHOLD = 128


# --------------------------------------------------------------------------
# Config, layers and builder, created the way the model runner creates them
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local HF config (no weights): enough for EngineArgs on a CPU box."""
    return h.write_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3"), num_layers=NUM_MODEL_LAYERS
    )


@dataclass
class Shape:
    preset: str = "turboquant_4bit_nc"
    num_heads: int = 2
    num_kv_heads: int = 1
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.float16


@dataclass
class TQ:
    """One TurboQuant attention group, built as the model runner builds it."""

    shape: Shape
    vllm_config: Any
    layers: list[Any]
    builder: Any
    kv_caches: list[torch.Tensor]
    device: torch.device
    tqa: Any  # the backend module of the tree under test
    generator: torch.Generator = field(default_factory=torch.Generator)


def make_vllm_config(
    model_dir: Path,
    shape: Shape,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None,
    enable_chunked_prefill: bool = True,
):
    return h.make_vllm_config(
        model_dir,
        preset=shape.preset,
        block_size=shape.block_size,
        dtype=shape.dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )


def build_layers(vllm_config, shape: Shape, num_layers: int, device: torch.device):
    """Attention layers as the model constructor makes them (impl included)."""
    layers = []
    for i in range(num_layers):
        layer = h.build_tq_attention(
            vllm_config,
            shape.num_heads,
            shape.head_size,
            shape.num_kv_heads,
            FIRST_TQ_LAYER + i,
        )
        assert layer.kv_cache_dtype == shape.preset
        layers.append(layer.to(device))
    return layers


def build_tq(
    model_dir: Path,
    device: torch.device,
    shape: Shape,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None,
    enable_chunked_prefill: bool = True,
    num_layers: int = 1,
    num_blocks: int,
    seed: int = 0,
) -> TQ:
    """init_workspace_manager -> model layers -> builder -> KV caches.

    The order of GPUModelRunner: the worker initializes the workspace
    manager, the model (and with it every attention impl) is built, then
    initialize_kv_cache creates the metadata builders and the caches;
    capture_model locks the workspace last (the caller does that).
    """
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from vllm.v1.worker.workspace import init_workspace_manager

    vllm_config = make_vllm_config(
        model_dir,
        shape,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    init_workspace_manager(device)
    layers = build_layers(vllm_config, shape, num_layers, device)
    builder = build_builder(vllm_config, shape, layers, device)
    generator = torch.Generator().manual_seed(seed)
    kv_caches = [
        random_tq_cache(shape, num_blocks, device, generator, h.soa_pages(x.impl))
        for x in layers
    ]
    return TQ(shape, vllm_config, layers, builder, kv_caches, device, tqa, generator)


def build_builder(vllm_config, shape: Shape, layers: list, device: torch.device):
    """The metadata builder, made from the layers' KV cache spec as
    initialize_kv_cache makes it (later trees reserve workspace here)."""
    spec = layers[0].get_kv_cache_spec(vllm_config)
    assert spec.block_size == shape.block_size
    return h.tq_builder(vllm_config, spec, [x.layer_name for x in layers], device)


@pytest.fixture
def tq_env(cpu_platform, vllm_tree, monkeypatch: pytest.MonkeyPatch):
    """A clean workspace manager per test (the manager is process-global),
    and model classes inspected in this process: vLLM's subprocess for it
    detects its own platform, CUDA on a GPU, which a source tree cannot load
    (no vllm._C)."""
    from vllm.v1.worker import workspace

    h.inspect_models_in_process(monkeypatch)
    workspace.reset_workspace_manager()
    yield workspace
    workspace.reset_workspace_manager()


def backend_module():
    import vllm.v1.attention.backends.turboquant_attn as tqa

    return tqa


def shrink_tile(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """Walk the context in tiles of ``tokens`` (before the impl is built)."""
    h.shrink_continuation_tile(backend_module(), tokens, monkeypatch.setattr)


def workspace_identity(workspace) -> tuple[int, int]:
    ws = workspace.current_workspace_manager()._current_workspaces[0]
    return (0, 0) if ws is None else (ws.data_ptr(), ws.numel())


def layer_tensors(layer) -> dict[str, tuple[int, int]]:
    """Every tensor a layer and its attention impl hold (attributes and
    buffers, and tensors in lists, tuples or dicts there): ptr and bytes."""
    found = {}
    owners = {"layer": layer, "impl": getattr(layer, "impl", None)}
    for who, obj in owners.items():
        if obj is None:
            continue
        items = list(vars(obj).items()) + list(getattr(obj, "_buffers", {}).items())
        for name, value in items:
            for i, t in enumerate(tree_leaves(value)):
                if isinstance(t, torch.Tensor):
                    key = f"{who}.{name}" + (f"[{i}]" if i else "")
                    found[key] = (t.data_ptr(), t.numel() * t.element_size())
    return found


# --------------------------------------------------------------------------
# The TurboQuant cache format, written and read independently in PyTorch
# --------------------------------------------------------------------------


def tq_config(shape: Shape):
    return h.tq_config(shape.preset, shape.head_size)


def centroids(shape: Shape) -> torch.Tensor:
    """The Lloyd-Max codebook (a layer attribute on some trees, not all)."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    return get_centroids(shape.head_size, tq_config(shape).centroid_bits)


def _put_fp16(cache: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    cache[..., offset : offset + 2] = (
        values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)
    )


def _get_fp16(slots: torch.Tensor, offset: int) -> torch.Tensor:
    pair = slots[..., offset : offset + 2].to(torch.uint8).contiguous()
    return pair.view(torch.float16).squeeze(-1).double()


def heads_before_positions() -> bool:
    """Whether the backend takes its cache as a (blocks, heads, positions,
    slot) view of (blocks, positions, heads, slot) memory, as later trees do
    (their forward() transposes it back), rather than the memory itself.
    Probed: the shape get_kv_cache_shape gives, or its absence (the layout
    then comes from supported_kv_cache_layouts: the view)."""
    from vllm.v1.attention.backends.turboquant_attn import (
        TurboQuantAttentionBackend as backend,
    )

    if not hasattr(backend, "get_kv_cache_shape"):
        return True
    shape = backend.get_kv_cache_shape(1, 16, 3, 128, "turboquant_4bit_nc")
    return shape[1:3] == (3, 16)


def physical(cache: torch.Tensor) -> torch.Tensor:
    """The (blocks, positions, heads, slot) memory behind a cache as forward()
    takes it."""
    return cache.transpose(1, 2) if heads_before_positions() else cache


def slot_layout(tq: TQ, cache: torch.Tensor) -> torch.Tensor:
    """``physical(cache)``, as slots (a copy where the impl stores
    turboquant_soa's pages)."""
    cfg = tq_config(tq.shape)
    soa = h.soa_pages(tq.layers[0].impl)
    return h.as_slots(physical(cache), cfg) if soa else physical(cache)


def random_tq_cache(
    shape: Shape,
    num_blocks: int,
    device: torch.device,
    gen: torch.Generator,
    soa: bool = False,
) -> torch.Tensor:
    """A cache of random, valid TurboQuant slots (fresh for every test), as
    forward() takes it (``soa``: in turboquant_soa's pages)."""
    cfg = tq_config(shape)
    D = shape.head_size
    cache_shape = (
        num_blocks,
        shape.block_size,
        shape.num_kv_heads,
        cfg.slot_size_aligned,
    )
    cache = torch.randint(0, 256, cache_shape, generator=gen, dtype=torch.uint8)
    lead = cache_shape[:-1]
    if cfg.key_fp8:
        keys = torch.randn(*lead, D, generator=gen)
        cache[..., :D] = keys.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        # Norm about sqrt(D): scores of order one, softmax neither flat nor
        # one-hot.
        norms = (0.5 + torch.rand(*lead, generator=gen)) * math.sqrt(D)
        _put_fp16(cache, math.ceil(D * cfg.key_mse_bits / 8), norms)
    val_base = cfg.key_packed_size
    val_bytes = math.ceil(D * cfg.effective_value_quant_bits / 8)
    levels = 2**cfg.effective_value_quant_bits - 1
    scales = (0.5 + torch.rand(*lead, generator=gen)) * 2.0 / levels
    zeros = -1.0 + 0.5 * torch.randn(*lead, generator=gen)
    _put_fp16(cache, val_base + val_bytes, scales)
    _put_fp16(cache, val_base + val_bytes + 2, zeros)
    cache = (h.as_soa(cache, cfg) if soa else cache).to(device)
    return cache.transpose(1, 2) if heads_before_positions() else cache


def _unpack(slots: torch.Tensor, base: int, bits: int, D: int) -> torch.Tensor:
    """Little-endian bit-packed codes: element d at bit d * bits."""
    bit = torch.arange(D, device=slots.device) * bits
    lo = slots[..., base + bit // 8]
    hi = slots[..., base + bit // 8 + 1]
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << bits) - 1)


def sylvester_hadamard(D: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(D)


def ref_dequant(
    tq: TQ, cache: torch.Tensor, blocks: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 K, V (length, Hk, D) of a request, in the model's space."""
    shape = tq.shape
    cfg = tq_config(shape)
    D = shape.head_size
    bs = shape.block_size
    pos = torch.arange(length, device=cache.device)
    slots = slot_layout(tq, cache)[blocks[pos // bs].long(), pos % bs].long()
    if cfg.key_fp8:
        raw = slots[..., :D].to(torch.uint8).contiguous()
        keys = raw.view(torch.float8_e4m3fn).double()
    else:
        idx = _unpack(slots, 0, cfg.key_mse_bits, D)
        unit = centroids(shape).double().to(cache.device)[idx]
        if cfg.norm_correction:
            unit = unit / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16)
        norms = _get_fp16(slots, math.ceil(D * cfg.key_mse_bits / 8))
        # Stored in the Hadamard-rotated domain; H is symmetric, orthonormal.
        H = sylvester_hadamard(D).to(cache.device)
        keys = (norms.unsqueeze(-1) * unit) @ H
    val_base = cfg.key_packed_size
    vqb = cfg.effective_value_quant_bits
    val_bytes = math.ceil(D * vqb / 8)
    codes = _unpack(slots, val_base, vqb, D).double()
    scales = _get_fp16(slots, val_base + val_bytes).unsqueeze(-1)
    zeros = _get_fp16(slots, val_base + val_bytes + 2).unsqueeze(-1)
    return keys, codes * scales + zeros


def ref_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 causal attention of the last q_len positions over k/v."""
    q_len, Hq, _ = q.shape
    k_len, Hk, _ = k.shape
    g = Hq // Hk
    kh = k.double().repeat_interleave(g, dim=1)  # query head h -> kv head h // g
    vh = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
    s = s.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vh)


# --------------------------------------------------------------------------
# Driving forward() with a batch
# --------------------------------------------------------------------------


@dataclass
class Req:
    """A request: context_len tokens already computed, q_len scheduled now."""

    context_len: int
    q_len: int
    blocks: torch.Tensor  # its block table row


def alloc_requests(tq: TQ, lens: list[tuple[int, int]], num_blocks: int) -> list[Req]:
    """Give each request its own random, non-contiguous cache blocks."""
    bs = tq.shape.block_size
    perm = torch.randperm(num_blocks, generator=tq.generator)
    reqs, used = [], 0
    for context_len, q_len in lens:
        n = math.ceil((context_len + q_len) / bs)
        assert used + n <= num_blocks, "test cache too small"
        blocks = perm[used : used + n].to(torch.int32).to(tq.device)
        reqs.append(Req(context_len, q_len, blocks))
        used += n
    return reqs


def run_batch(
    tq: TQ,
    reqs: list[Req],
    layer_idx: int = 0,
    check: bool = True,
    around_forward: Any = None,
):
    """One forward() of a batch (decodes first, as the runner orders it).

    Queries are fresh random; each request's new K/V are its slots'
    dequantized values, so the float64 reference is exact for every path.
    Returns the max abs error against the reference.
    """
    shape, device = tq.shape, tq.device
    layer, cache = tq.layers[layer_idx], tq.kv_caches[layer_idx]
    Hq, Hk, D = shape.num_heads, shape.num_kv_heads, shape.head_size
    bs = shape.block_size
    max_blocks = max(len(r.blocks) for r in reqs)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32, device=device)
    qs, ks, vs, refs, slot_mapping = [], [], [], [], []
    for i, r in enumerate(reqs):
        seq_len = r.context_len + r.q_len
        block_table[i, : len(r.blocks)] = r.blocks
        k_all, v_all = ref_dequant(tq, cache, r.blocks, seq_len)
        q = torch.randn(r.q_len, Hq, D, generator=tq.generator).to(device)
        qs.append(q.to(shape.dtype))
        ks.append(k_all[r.context_len :].to(shape.dtype))
        vs.append(v_all[r.context_len :].to(shape.dtype))
        refs.append(ref_attention(qs[-1], k_all, v_all, layer.impl.scale))
        pos = torch.arange(r.context_len, seq_len, device=device)
        slot_mapping.append(r.blocks[pos // bs].long() * bs + pos % bs)
    q_lens = torch.tensor([r.q_len for r in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([r.context_len + r.q_len for r in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(qsl[-1])
    cam = h.common_attn_metadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=len(reqs),
        num_actual_tokens=num_tokens,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.cat(slot_mapping),
        seq_lens_cpu_upper_bound=seq_lens,
        _seq_lens_cpu=seq_lens,
        _num_computed_tokens_cpu=seq_lens - q_lens,
    )
    metadata = tq.builder.build(0, cam)
    query = torch.cat(qs).reshape(num_tokens, Hq * D)
    key = torch.cat(ks).reshape(num_tokens, Hk * D)
    value = torch.cat(vs).reshape(num_tokens, Hk * D)
    output = torch.empty(num_tokens, Hq * D, dtype=shape.dtype, device=device)

    def forward() -> None:
        layer.impl.forward(layer, query, key, value, cache, metadata, output=output)

    if around_forward is None:
        forward()
    else:
        around_forward(forward)
    got = output.view(num_tokens, Hq, D).double()
    want = torch.cat(refs)
    err = (got - want).abs().max().item()
    if check:
        atol = 2e-2 if shape.dtype == torch.float16 else 6e-2
        torch.testing.assert_close(got, want, atol=atol, rtol=2e-2)
    return err


def use_attention_path(
    monkeypatch: pytest.MonkeyPatch, tq_module, path: str, fa_version: int | None = 3
) -> h.ReferenceFlashAttn | None:
    """'sdpa': vLLM without flash-attn; 'flash': flash-attn (faked on CPU)."""
    if path == "sdpa":
        monkeypatch.setattr(tq_module, "_HAS_FLASH_ATTN", False)
        return None
    fake = None
    if not HAS_CUDA or not tq_module.is_flash_attn_varlen_func_available():
        # No vLLM flash-attn: a CPU box, or a GPU running a source tree (its
        # flash-attn is a compiled extension).
        fake = h.ReferenceFlashAttn()
        monkeypatch.setattr(tq_module, "flash_attn_varlen_func", fake, raising=False)
    monkeypatch.setattr(tq_module, "_HAS_FLASH_ATTN", True)
    return fake


def set_fa_version(tq: TQ, fa_version: int | None) -> None:
    if not HAS_CUDA:  # on a GPU keep the version the impl detected
        for layer in tq.layers:
            layer.impl.fa_version = fa_version


# --------------------------------------------------------------------------
# Regression: nothing is allocated after the workspace is locked
# --------------------------------------------------------------------------

if HAS_CUDA:
    REG_MAX_MODEL_LEN, REG_MAX_BATCHED = 32768, 8192
else:
    REG_MAX_MODEL_LEN, REG_MAX_BATCHED = 512, 256


# v0.21.0+: the continuation allocates from the locked workspace.
LOCKED_WORKSPACE = r"Workspace is locked but allocation from .*_continuation_prefill"


@pytest.mark.bug_signature(AssertionError, LOCKED_WORKSPACE)
@pytest.mark.bug_signature(AssertionError, r"^workspace reallocated")
@pytest.mark.bug_signature(
    AssertionError, r"^per-layer buffers (created|reallocated) after lock"
)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_continuation_prefill_after_workspace_lock(
    tq_env, tiny_model_dir: Path, device: torch.device, chunked: bool
) -> None:
    """vllm#41726: continuation prefills up to max_model_len after lock.

    Workspace manager initialized, impls and builder created as the runner
    does, a decode warm-up, then lock_workspace(). Continuation prefills
    with q_len up to max_num_batched_tokens and cached_len up to
    max_model_len - q_len, through every layer, must neither grow the
    workspace (v0.21.0 raises here) nor hang per-layer buffers on the
    layers (v0.20.2 does). With chunked prefill on and off: without it a
    continuation still comes from a prefix-cache or KV-connector hit, or a
    resumed request, and v0.24.0 .. v0.33.0 reserve nothing for it then.
    """
    shape = Shape(preset="turboquant_4bit_nc", num_heads=2, num_kv_heads=1)
    num_blocks = 2 * REG_MAX_MODEL_LEN // shape.block_size + 4
    tq = build_tq(
        tiny_model_dir,
        device,
        shape,
        max_model_len=REG_MAX_MODEL_LEN,
        max_num_batched_tokens=REG_MAX_BATCHED if chunked else None,
        enable_chunked_prefill=chunked,
        num_layers=2,
        num_blocks=num_blocks,
    )
    # Warm-up as in the runner's dummy runs: a decode batch per layer.
    for i in range(len(tq.layers)):
        run_batch(tq, alloc_requests(tq, [(31, 1), (7, 1)], num_blocks), i)
    before = [layer_tensors(layer) for layer in tq.layers]
    reserved = workspace_identity(tq_env)
    tq_env.lock_workspace()

    cases = [
        (REG_MAX_MODEL_LEN - REG_MAX_BATCHED, REG_MAX_BATCHED),
        (REG_MAX_MODEL_LEN - DECODE_THRESHOLD - 1, DECODE_THRESHOLD + 1),
    ]
    for cached_len, q_len in cases:
        assert cached_len + q_len <= REG_MAX_MODEL_LEN
        for i in range(len(tq.layers)):
            reqs = alloc_requests(tq, [(cached_len, q_len)], num_blocks)
            run_batch(tq, reqs, i)

    assert workspace_identity(tq_env) == reserved, "workspace reallocated"
    # Context-sized buffers hung on a layer or its impl after the lock (a
    # row of dequantized K or V is at least 64 bytes per cached token;
    # constant-size scalars made on first use are not the bug).
    context = min(c for c, _ in cases)
    for layer, tensors in zip(tq.layers, before, strict=True):
        after = layer_tensors(layer)
        big = {n for n, (_, nbytes) in after.items() if nbytes >= 64 * context}
        new = sorted(big - set(tensors))
        assert not new, f"per-layer buffers created after lock: {new}"
        changed = sorted(n for n in big & set(tensors) if after[n] != tensors[n])
        assert not changed, f"per-layer buffers reallocated after lock: {changed}"


# --------------------------------------------------------------------------
# Bounded: the reservation does not depend on max_model_len
# --------------------------------------------------------------------------


@pytest.mark.parametrize("head_size,num_kv_heads", [(128, 8), (256, 4)])
def test_reserved_workspace_independent_of_max_model_len(
    tq_env, tiny_model_dir: Path, device: torch.device, head_size, num_kv_heads
) -> None:
    shape = Shape(
        num_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads, head_size=head_size
    )
    reserved = {}
    for max_model_len in (8192, 1 << 20):
        tq_env.reset_workspace_manager()
        tq_env.init_workspace_manager(device)
        vllm_config = make_vllm_config(
            tiny_model_dir,
            shape,
            max_model_len=max_model_len,
            max_num_batched_tokens=4096,
        )
        build_builder(
            vllm_config, shape, build_layers(vllm_config, shape, 3, device), device
        )
        reserved[max_model_len] = h.workspace_bytes()
    assert reserved[8192] > 0, "nothing reserved before lock"
    assert reserved[8192] == reserved[1 << 20], reserved

    # Chunked prefill off: max_num_batched_tokens follows max_model_len (1M),
    # the tile must not.
    tq_env.reset_workspace_manager()
    tq_env.init_workspace_manager(device)
    vllm_config = make_vllm_config(
        tiny_model_dir,
        shape,
        max_model_len=1 << 20,
        max_num_batched_tokens=None,
        enable_chunked_prefill=False,
    )
    assert vllm_config.scheduler_config.max_num_batched_tokens >= 1 << 20
    build_builder(
        vllm_config, shape, build_layers(vllm_config, shape, 1, device), device
    )
    full_dequant_1m = 2 * (1 << 20) * num_kv_heads * head_size * 2
    assert 0 < h.workspace_bytes() <= full_dequant_1m // 32


@pytest.mark.bug_signature(AssertionError, LOCKED_WORKSPACE)
@pytest.mark.bug_signature(AssertionError, r"^temporaries grow with the context")
@pytest.mark.bug_signature(AssertionError, r"^a flash-attn call spans more than")
@pytest.mark.parametrize("path", ["sdpa", "flash"])
def test_continuation_temporaries_bounded_by_tile(
    tq_env, tiny_model_dir, device, monkeypatch, path
) -> None:
    """No tensor made during a continuation grows with the cached context.

    Two contexts of many tiles (cached_len >> q_len) that end with a partial
    tile of the same length: every allocation of the longer one must have a
    size the shorter one also allocates, so no buffer is sized by the
    context (not only the largest, which is the q_len-sized scores). In
    particular the path without flash-attn builds no q_len x seq_len mask
    and no dequantized copy of the whole context.
    """
    tile = 32
    shrink_tile(monkeypatch, tile)
    fake = use_attention_path(monkeypatch, backend_module(), path)
    shape = Shape(preset="turboquant_k3v4_nc", num_heads=2, num_kv_heads=1)
    num_blocks = 80
    tq = build_tq(
        tiny_model_dir,
        device,
        shape,
        max_model_len=2048,
        max_num_batched_tokens=256,
        num_blocks=num_blocks,
    )
    set_fa_version(tq, 3)
    tq_env.lock_workspace()
    q_len = DECODE_THRESHOLD + 2
    sizes = {}
    for cached_len in (4 * tile + 5, 24 * tile + 5):
        reqs = alloc_requests(tq, [(cached_len, q_len)], num_blocks)
        spied: list[set[int]] = []
        run_batch(
            tq,
            reqs,
            around_forward=lambda fn, o=spied: o.append(h.new_storage_sizes(fn)),
        )
        sizes[cached_len] = spied[0]
    small, large = sizes.values()
    # Context-sized means at least 64 bytes per cached token (a row of
    # dequantized K or V, a mask or score row per query); smaller index
    # vectors (upstream keeps an arange of positions for its decode path)
    # are not what this bounds.
    grown = sorted(n for n in large - small if n >= 64 * (4 * tile + 5))
    assert not grown, (
        f"temporaries grow with the context: sizes {grown} appear only at "
        f"cached_len {24 * tile + 5} (largest at {4 * tile + 5}: {max(small)})"
    )
    if fake is not None:
        assert max(fake.k_lens) <= max(tile, q_len), (
            f"a flash-attn call spans more than a tile: keys {fake.k_lens}"
        )


# --------------------------------------------------------------------------
# Correctness against float64 attention over the dequantized cache
# --------------------------------------------------------------------------

# (preset, Hq, Hk, D, block, tile, cached_len, q_len, path, dtype): every
# preset, GQA and MHA, D 128 and 256, each kernel block size, contexts that
# are and are not multiples of the tile / block, both attention paths.
CORRECTNESS_CASES = [
    ("turboquant_4bit_nc", 4, 1, 128, 16, 64, 200, 150, "sdpa", torch.float16),
    ("turboquant_k8v4", 2, 2, 256, 32, 64, 160, 140, "flash", torch.bfloat16),
    ("turboquant_k3v4_nc", 4, 1, 256, 64, 64, 192, 129, "sdpa", torch.float16),
    ("turboquant_3bit_nc", 2, 2, 128, 128, 128, 130, 200, "flash", torch.float16),
    ("turboquant_4bit_nc", 2, 2, 256, 16, 128, 100, 300, "flash", torch.float16),
    ("turboquant_k8v4", 4, 1, 128, 64, 64, 256, 129, "sdpa", torch.bfloat16),
    ("turboquant_3bit_nc", 4, 1, 256, 32, 32, 97, 133, "sdpa", torch.float16),
    ("turboquant_k3v4_nc", 2, 2, 128, 16, 32, 80, 160, "flash", torch.bfloat16),
]


@pytest.mark.parametrize(
    "preset,Hq,Hk,D,block,tile,cached_len,q_len,path,dtype",
    CORRECTNESS_CASES,
    ids=[f"{c[0][11:]}-h{c[1]}k{c[2]}d{c[3]}b{c[4]}-{c[8]}" for c in CORRECTNESS_CASES],
)
def test_continuation_matches_full_attention(
    tq_env,
    tiny_model_dir,
    device,
    monkeypatch,
    preset,
    Hq,
    Hk,
    D,
    block,
    tile,
    cached_len,
    q_len,
    path,
    dtype,
) -> None:
    scale_up = 8 if HAS_CUDA else 1
    shrink_tile(monkeypatch, tile * scale_up)
    use_attention_path(monkeypatch, backend_module(), path)
    shape = Shape(preset, Hq, Hk, D, block, dtype)
    cached_len, q_len = cached_len * scale_up, q_len * scale_up
    num_blocks = 2 * math.ceil((cached_len + q_len) / block) + 2
    tq = build_tq(
        tiny_model_dir,
        device,
        shape,
        max_model_len=4096 * scale_up,
        max_num_batched_tokens=512 * scale_up,
        num_blocks=num_blocks,
        seed=sum(map(ord, preset)) + 10 * Hq + D + block,
    )
    set_fa_version(tq, None if path == "flash" and D == 128 else 3)
    tq_env.lock_workspace()
    run_batch(tq, alloc_requests(tq, [(cached_len, q_len)], num_blocks))


def _v0202_continuation(impl, layer, q, k_chunk, v_chunk, cache, bt, cached_len):
    """v0.20.2's algorithm (whole-context dequant, dense masked SDPA) in a
    test: the unpatched path, on the same cache, for comparison."""
    import torch.nn.functional as F
    import vllm.v1.attention.backends.turboquant_attn as tqa

    q_len, Hq, D = q.shape
    Hk = k_chunk.shape[1]
    bs = cache.shape[1]
    cfg = impl.tq_config
    alloc_len = math.ceil(cached_len / bs) * bs
    k_buf = torch.zeros(1, Hk, alloc_len, D, dtype=torch.float16, device=q.device)
    v_buf = torch.zeros_like(k_buf)
    tqa._tq_full_dequant_kv[(alloc_len, Hk)](
        cache, bt, layer._tq_centroids, k_buf, v_buf,
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
        v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), bt.stride(0),
        HEAD_DIM=D, BLOCK_SIZE=bs, NUM_KV_HEADS=Hk, MSE_BYTES=impl._mse_bytes,
        KPS=cfg.key_packed_size, VQB=cfg.effective_value_quant_bits,
        VAL_DATA_BYTES=impl._val_data_bytes, MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=int(cfg.key_fp8), BLOCK_D=triton_next_pow2(D),
        NORM_CORRECTION=int(cfg.norm_correction), FP8_E4B15=0, num_warps=4,
    )  # fmt: skip
    k_c = k_buf[0, :, :cached_len].transpose(0, 1)
    if not cfg.key_fp8:
        k_c = (k_c.float() @ layer._tq_Pi).to(torch.float16)
    v_c = v_buf[0, :, :cached_len].transpose(0, 1)
    k_full = torch.cat([k_c.to(q.dtype), k_chunk]).transpose(0, 1).unsqueeze(0)
    v_full = torch.cat([v_c.to(q.dtype), v_chunk]).transpose(0, 1).unsqueeze(0)
    seq_len = cached_len + q_len
    q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + cached_len
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_full,
        v_full,
        attn_mask=mask,
        scale=impl.scale,
        enable_gqa=Hk < Hq,
    )
    return out[0].transpose(0, 1)


# The attention without flash-attn takes PyTorch's fused kernels: the CPU
# flash kernel on CPU; FlashAttention-2 or the memory-efficient kernel on CUDA.
FUSED_KINDS = ("flash", "efficient") if HAS_CUDA else ("cpu",)


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32],
    ids=["fp16", "bf16", "fp32"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["chunk", "tile"])
def test_fused_attention_with_lse(
    tq_env, device, monkeypatch, kind, dtype, causal
) -> None:
    """PyTorch's fused attention with its log-sum-exp, as the continuation
    calls it without flash-attn (the chunk's own keys causally, a context
    tile without a mask), against float64: grouped and plain heads."""
    tqa = backend_module()
    if not hasattr(tqa, "_fused_attention_with_lse"):
        pytest.skip("tree without the fused no-flash-attn path")
    if kind == "flash" and dtype == torch.float32:
        pytest.skip("FlashAttention-2 takes 16-bit inputs only")
    monkeypatch.setattr(tqa, "_fused_attention_kind", lambda *args: kind)
    g = torch.Generator(device=device).manual_seed(11)
    for Hq, Hk, D in ((4, 1, 128), (8, 2, 256), (2, 2, 64)):
        q_len = 37
        k_len = q_len if causal else 100
        q, k, v = (
            torch.randn(n, h_, D, generator=g, device=device).to(dtype)
            for n, h_ in ((q_len, Hq), (k_len, Hk), (k_len, Hk))
        )
        scale = D**-0.5
        out, lse = tqa._fused_attention_with_lse(q, k, v, causal, scale)
        rep = Hq // Hk
        s = torch.einsum(
            "qhd,khd->hqk", q.double(), k.double().repeat_interleave(rep, 1)
        )
        s = s * scale
        if causal:
            hidden = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
            s = s.masked_fill(hidden.triu(1), float("-inf"))
        want = torch.einsum(
            "hqk,khd->qhd", s.softmax(-1), v.double().repeat_interleave(rep, 1)
        )
        assert out.shape == (q_len, Hq, D) and lse.shape == (Hq, q_len)
        atol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=1e-2)
        torch.testing.assert_close(lse.double(), s.logsumexp(-1), atol=atol, rtol=1e-3)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize(
    "preset,Hq,Hk,D,path",
    [
        ("turboquant_4bit_nc", 4, 1, 128, "sdpa"),
        ("turboquant_k8v4", 2, 2, 256, "flash"),
    ],
)
def test_continuation_matches_unpatched_path(
    tq_env, tiny_model_dir, device, monkeypatch, preset, Hq, Hk, D, path
) -> None:
    """Same quantized cache, same inputs: tiled result == v0.20.2's dense one
    (and both == the float64 reference)."""
    scale_up = 8 if HAS_CUDA else 1
    shrink_tile(monkeypatch, 32 * scale_up)
    use_attention_path(monkeypatch, backend_module(), path)
    shape = Shape(preset, Hq, Hk, D, 16, torch.float16)
    cached_len, q_len = 90 * scale_up, 130 * scale_up
    num_blocks = 2 * math.ceil((cached_len + q_len) / 16) + 2
    tq = build_tq(
        tiny_model_dir,
        device,
        shape,
        max_model_len=4096,
        max_num_batched_tokens=512,
        num_blocks=num_blocks,
        seed=7,
    )
    layer, impl, cache = tq.layers[0], tq.layers[0].impl, tq.kv_caches[0]
    (req,) = alloc_requests(tq, [(cached_len, q_len)], num_blocks)
    k_all, v_all = ref_dequant(tq, cache, req.blocks, cached_len + q_len)
    q = torch.randn(q_len, Hq, D, generator=tq.generator).to(device, torch.float16)
    k_chunk = k_all[cached_len:].to(torch.float16)
    v_chunk = v_all[cached_len:].to(torch.float16)
    bt = req.blocks.unsqueeze(0)
    impl._ensure_on_device(layer, device)
    # both continuations take the cache as the kernels read it
    unpatched = _v0202_continuation(
        impl, layer, q, k_chunk, v_chunk, slot_layout(tq, cache), bt, cached_len
    )
    patched = impl._continuation_prefill(
        query=q,
        key_chunk=k_chunk,
        val_chunk=v_chunk,
        kv_cache=physical(cache),
        block_table=bt,
        cached_len=cached_len,
        Pi=layer._tq_Pi,
        centroids=layer._tq_centroids,
    )
    want = ref_attention(q, k_all, v_all, impl.scale)
    torch.testing.assert_close(unpatched.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        patched.double(), unpatched.double(), atol=1e-2, rtol=1e-2
    )


# --------------------------------------------------------------------------
# Property: a long prompt chunked at random boundaries, with decodes mixed in
# --------------------------------------------------------------------------


PROPERTY_MAX_BATCHED = 256


@st.composite
def chunked_prompts(draw):
    # The first chunk has no context: any size. Later chunks of at most 128
    # tokens take the decode kernel, which Triton's interpreter runs far too
    # slowly at these context lengths, so on CPU every later chunk is a
    # continuation prefill (with CUDA any size).
    smallest = 1 if HAS_CUDA else DECODE_THRESHOLD + 1
    first = draw(st.integers(1, PROPERTY_MAX_BATCHED))
    rest = draw(
        st.lists(
            st.integers(smallest, PROPERTY_MAX_BATCHED),
            min_size=1,
            max_size=8 if HAS_CUDA else 2,
        )
    )
    return {
        "chunks": [first, *rest],
        "decodes": draw(st.lists(st.integers(1, 40), max_size=2)),
        "preset": draw(st.sampled_from(PRESETS)),
        "block": draw(st.sampled_from([16, 32, 64])),
        "path": draw(st.sampled_from(["sdpa", "flash"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(
    # The same cases on every run (conftest's profile); few on CPU, where
    # Triton's interpreter is slow.
    max_examples=20 if HAS_CUDA else 6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=chunked_prompts())
# Always: contexts of several tiles, a partial last tile, decodes mixed in.
@example(
    case={
        "chunks": [130, 135, 140],
        "decodes": [37, 3],
        "preset": "turboquant_4bit_nc",
        "block": 32,
        "path": "flash",
        "seed": 1,
    }
)
@example(
    case={
        "chunks": [70, 129, 250],
        "decodes": [12],
        "preset": "turboquant_k8v4",
        "block": 64,
        "path": "sdpa",
        "seed": 2,
    }
)
def test_chunked_prompt_property(
    tq_env, tiny_model_dir, device, monkeypatch, case
) -> None:
    """forward() over random chunk boundaries, decodes in the same batches:
    matches float64 attention and never touches the workspace's size."""
    tile = 64  # a multiple of every block size drawn
    with monkeypatch.context() as mp:
        shrink_tile(mp, tile)
        use_attention_path(mp, backend_module(), case["path"])
        tq_env.reset_workspace_manager()
        shape = Shape(case["preset"], 2, 1, 128, case["block"], torch.float16)
        prompt_len = sum(case["chunks"])
        num_blocks = 2 * math.ceil((prompt_len + 64) / case["block"]) + 8
        tq = build_tq(
            tiny_model_dir,
            device,
            shape,
            max_model_len=4096 if HAS_CUDA else 1024,
            max_num_batched_tokens=PROPERTY_MAX_BATCHED,
            num_blocks=num_blocks,
            seed=case["seed"],
        )
        set_fa_version(tq, 3)
        tq_env.lock_workspace()
        reserved = workspace_identity(tq_env)
        steps = len(case["chunks"])
        lens = [(0, prompt_len)] + [(c + steps - 1, 1) for c in case["decodes"]]
        prompt, *decodes = alloc_requests(tq, lens, num_blocks)
        done = 0
        for step, size in enumerate(case["chunks"]):
            batch = [
                Req(c + step, 1, d.blocks) for c, d in zip(case["decodes"], decodes)
            ]
            batch.append(Req(done, size, prompt.blocks))
            run_batch(tq, batch)
            done += size
        assert workspace_identity(tq_env) == reserved
        layer = tq.layers[0]
        assert not [n for n in vars(layer) if "dequant" in n], vars(layer).keys()
