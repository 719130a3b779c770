"""Batches as vLLM's scheduler and model runner form them, run through a
tree's TurboQuant backend (or UltraQuant, its v0.32.0+ subclass: the preset
``ultraquant_4bit``), and the float64 reference every row must match.

Built on ``tqharness`` (config, impl, builder, cache layout, metadata of the
tree under test); shared by test_tq_host_metadata.py (hand-picked batches)
and test_tq_batches.py (generated ones).

A step is what the runner does: the scheduled tokens' K/V stored with the
tree's store kernel (``do_kv_cache_update``), then ``forward`` on metadata
from the tree's builder. The context of every request was stored by earlier
steps, with the same kernel, into a cache of random bytes (a slot nobody
wrote reads as garbage).

API:

``Shape`` / ``open_backend(tree, model_dir, shape, setattr)``
    The test shapes, and a ``Backend``: the tree's TurboQuant module, a
    real config and the KV cache spec of a real TurboQuant layer, with the
    workspace manager made first, as the runner does. ``close_backend()``.
``UQ_SHAPE`` / ``open_ultraquant(tree, model_dir, setattr, shape, threshold,
**config)``
    The same for UltraQuant (skipped before v0.32.0).
``Backend.impl()`` / ``.layer(impl)`` / ``.builder()``
    A bare impl, the layer state it reads (centroids), the builder.
``Req(cached, q, prefix=None)``
    A request: tokens already cached, tokens scheduled this step, and the
    row and number of blocks it shares (a prefix-cache hit).
``make_batch(backend, impl, layer, reqs, seed, optimistic=None, pad_tokens=0,
pad_reqs=0)``
    The batch's ``Batch``: cache, inputs, metadata as the runner passes it
    (``optimistic``: async spec decode's host upper bound per row; padding
    as the runner pads for CUDA graphs).
``run_step(impl, layer, batch, meta)`` / ``forward(impl, layer, batch, meta)``
    Cache update, then forward: the output rows; forward alone (every row).
``decode_batch(backend, cached, seed)``
    Decodes after ``cached`` tokens each, their new K/V already stored.
``decode_kernels(impl, layer, batch, splits, pad=0)``
    The tree's decode kernels on the batch's cache (v0.33.0's and the
    grouped one, ``splits`` splits), ``pad`` rows of no tokens appended.
``stage1_launches()`` / ``decode_step(backend)`` / ``check_regs_step(backend,
many)``
    The grouped decode's stage-1 launches while open ("first", "regs"); a
    decode step through ``forward``: its launches, output and reference;
    a step's grouped decode on the registers stage 1 within the suite's
    bound of v0.33.0's kernel's error on the same cache.
``env_cases(shapes)`` / ``cases_fixture(name, hq, hk, head)``
    A test parametrized by (preset, query dtype) for its ``env`` fixture,
    and that fixture: the tree's backend at one shape for each case.
``slot_twin(backend, reqs)`` / ``page_layout(batch, slots, cfg, reqs)``
    A batch whose context the backend stored, beside the same K/V in a cache
    of slots by v0.33.0's slot store; which layout the backend's pages hold.
``half_ulp(dtype, x)``
    The rounding of a correctly rounded output of ``dtype`` near max |x|.
``capture_metadata(builder, batch, watch)`` / ``refill(bufs, batch)``
    Metadata for a full-graph capture of the batch's shape (the runner's
    dummy values), and what a replay changes: the device buffers' contents.
``reference(batch, impl, layer)`` / ``row_paths(reqs, threshold)``
    Each row's expected output in float64, over K/V read back from the
    cache bytes by ``dequant`` / ``uq_dequant`` (not with vLLM's kernels).
``check_rows(out, batch, impl, layer)``
    Every request's rows within ``tolerance(impl)`` of the reference, or an
    AssertionError naming the first wrong request, its batch and what it
    did where that can be told ("ignores its cached context": vllm#46460).
``use_attention(mode, backend, setattr)`` / ``new_impl(backend, mode)``
    flash-attn's code paths on or off (a float64 stand-in where the tree has
    no vLLM flash-attn), and an impl for that mode.
``check_replay(backend, impl, layer, real, pad)`` / ``check_async(backend,
impl, layer, reqs, over, seed)``
    A full-graph capture and replay against an eager step; async host upper
    bounds against exact ones (bit-identical, and right).
``device_only(t)`` / ``plain(t)`` / ``watched(cam)`` / ``HostReadError``
    The host-read detector: device tensors of the metadata that vLLM code
    must not read on the host (a sync; a crash under graph capture).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import tqharness as h

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Queries in one continuation chunk above which TurboQuant leaves the decode
# kernel for the dequant + attention path (_CONTINUATION_DECODE_THRESHOLD).
THRESHOLD = 128


@dataclass(frozen=True)
class Shape:
    """Small shapes: on CPU every Triton kernel runs in the interpreter."""

    hq: int = 2
    hk: int = 1
    head: int = 32
    block: int = 16
    preset: str = "turboquant_4bit_nc"
    dtype: torch.dtype = torch.float16
    max_model_len: int = 512  # longer than any request; a capture's max_seq_len


# --------------------------------------------------------------------------
# Host-read detector
# --------------------------------------------------------------------------


class HostReadError(AssertionError):
    """vLLM code read a device tensor of the attention metadata on the host."""


_READS = frozenset(
    {
        "tolist",
        "item",
        "cpu",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__complex__",
        "__index__",
        "__array__",
        "__repr__",
        "__format__",
        "equal",
        "allclose",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
    }
)
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_THIS_FILE = str(Path(__file__).resolve())
_vllm_dir: str | None = None  # set by open_backend


def _is_host_read(func: Any, args: tuple, kwargs: dict | None) -> bool:
    name = getattr(func, "__name__", "")
    if name in _READS:
        return True
    if name == "repeat_interleave":  # syncs unless output_size is given
        return not (kwargs or {}).get("output_size")
    if name == "to":
        targets = [*args[1:], *(kwargs or {}).values()]
        return any(
            (isinstance(t, str) and t == "cpu")
            or (HAS_CUDA and isinstance(t, torch.device) and t.type == "cpu")
            for t in targets
        )
    return False


def _caller() -> tuple[str, int]:
    """File and line of the nearest caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = str(Path(frame.f_code.co_filename).resolve())
        if not filename.startswith(_TORCH_DIR) and filename != _THIS_FILE:
            return filename, frame.f_lineno
        frame = frame.f_back
    return "?", 0


class DeviceOnly(torch.Tensor):
    """A tensor standing for device memory: vLLM code must not read it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _is_host_read(func, args, kwargs):
            filename, line = _caller()
            if _vllm_dir is not None and filename.startswith(_vllm_dir):
                rel = os.path.relpath(filename, str(Path(_vllm_dir).parent))
                raise HostReadError(
                    f"host read {getattr(func, '__name__', func)}() of a device "
                    f"tensor of the attention metadata at {rel}:{line}"
                )
        return super().__torch_function__(func, types, args, kwargs)


def device_only(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceOnly)


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def watched(cam: Any) -> Any:
    """The same metadata with its device tensors wrapped by the detector."""
    return h.cam_replace(
        cam,
        query_start_loc=device_only(cam.query_start_loc),
        seq_lens=device_only(cam.seq_lens),
        block_table_tensor=device_only(cam.block_table_tensor),
        slot_mapping=device_only(cam.slot_mapping),
    )


# --------------------------------------------------------------------------
# The backend under test
# --------------------------------------------------------------------------


@dataclass
class Backend:
    tq: Any  # the tree's turboquant_attn module
    config: Any
    spec: Any
    layer_name: str
    tree: Path
    shape: Shape

    @property
    def modules(self) -> tuple[Any, ...]:
        """The modules whose globals the backend reads (UltraQuant's copies
        TurboQuant's flags at import: patch both)."""
        return h.backend_modules(self.shape.preset)

    def __repr__(self) -> str:  # keep hypothesis' failure reports short
        return f"Backend({self.shape.preset})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))

    def impl(self, tq: Any = None) -> Any:
        s = self.shape
        module = tq or self.modules[-1]
        return h.tq_impl(self.config, s.hq, s.head, s.hk, s.preset, module)

    def layer(self, impl: Any) -> torch.nn.Module:
        if h.is_ultraquant(self.shape.preset):
            return torch.nn.Module()  # no centroids: FP4 codes, UE8M0 scales
        return h.centroids_layer(impl, self.shape.head, DEVICE)

    def builder(self, tq: Any = None) -> Any:
        return h.tq_builder(
            self.config, self.spec, [self.layer_name], DEVICE, tq or self.tq
        )


def small_continuation_splits(tq: Any, splits: int, setattr: Any) -> None:
    """The small continuation launches the decode kernel without a split
    count, so with the launcher's default of 32: ``splits`` instead where a
    caller passes neither a count nor buffers sized for one (the decode
    path passes both). In Triton's interpreter a launch costs per program,
    and a context of tens of tokens leaves most of 32 splits empty."""
    launch = tq.triton_turboquant_decode_attention

    def with_splits(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "max_num_kv_splits" not in kwargs and kwargs.get("mid_o_buf") is None:
            kwargs["max_num_kv_splits"] = splits
        return launch(*args, **kwargs)

    setattr(tq, "triton_turboquant_decode_attention", with_splits)


def open_backend(
    tree: Path, model_dir: Path, shape: Shape, setattr: Any, **config: Any
) -> Backend:
    """The tree's TurboQuant backend under a real config for a tiny model of
    ``shape`` (``setattr``: a monkeypatch's, to undo the platform;
    ``config``: more of ``tqharness.make_vllm_config``'s arguments)."""
    global _vllm_dir
    h.install_platform(tree, setattr)
    from vllm.v1.worker import workspace

    tq = importlib.import_module(h.TQ_MODULE)
    h.inspect_models_in_process()
    h.write_tiny_model(
        model_dir,
        num_heads=shape.hq,
        num_kv_heads=shape.hk,
        head_dim=shape.head,
        dtype="bfloat16" if shape.dtype == torch.bfloat16 else "float16",
    )
    # A real config: the builder (v0.24.0+) and the impl (v0.28.0+) read the
    # model, scheduler and attention configs.
    config = h.make_vllm_config(
        model_dir,
        preset=shape.preset,
        block_size=shape.block,
        max_model_len=shape.max_model_len,
        dtype=shape.dtype,
        **config,
    )
    _vllm_dir = str((tree / "vllm").resolve()) + os.sep
    # As the model runner does, the workspace manager exists before any
    # attention layer is built: continuation prefill takes its dequant
    # buffers from it in later releases (v0.21.0+) and with tq/0001.
    workspace.init_workspace_manager(DEVICE)
    backend = h.backend_class(shape.preset)
    attn = h.build_tq_attention(config, shape.hq, shape.head, shape.hk, None, backend)
    spec = h.runner_kv_cache_spec(attn, config)
    quantized = h.is_turboquant_spec(spec) or h.is_ultraquant(shape.preset)
    assert quantized and spec.block_size == shape.block
    return Backend(tq, config, spec, attn.layer_name, tree, shape)


# UltraQuant: bf16 (its Triton decode takes no fp16), 64-token blocks (its
# preferred block size), head_dim a power of two (Hadamard), grouped queries.
UQ_SHAPE = Shape(
    hq=4,
    hk=2,
    head=64,
    block=64,
    preset=h.UQ_PRESET,
    dtype=torch.bfloat16,
    max_model_len=1024,
)


def open_ultraquant(
    tree: Path,
    model_dir: Path,
    setattr: Any,
    shape: Shape = UQ_SHAPE,
    threshold: int | None = None,
    **config: Any,
) -> Backend:
    """``open_backend`` for UltraQuant (v0.32.0+; the test is skipped on
    earlier trees), with Triton's interpreter's bf16 dot fixed and the
    continuation threshold set to ``threshold`` queries where given."""
    import pytest

    if not (tree / "vllm/v1/attention/backends/ultraquant_attn.py").is_file():
        pytest.skip("no UltraQuant backend in this tree (v0.32.0+)")
    h.fix_interpreter_bf16_dot(setattr)
    backend = open_backend(tree, model_dir, shape, setattr, **config)
    if threshold is not None:
        for module in backend.modules:
            setattr(module, "_CONTINUATION_DECODE_THRESHOLD", threshold)
    return backend


def close_backend() -> None:
    global _vllm_dir
    from vllm.v1.worker import workspace

    workspace.reset_workspace_manager()
    _vllm_dir = None


def backend_fixture(
    tree: Path, tmp_path_factory: Any, shape: Shape, name: str, **config: Any
):
    """A fixture's body: the tree's backend at ``shape`` (a tiny model in a
    temporary folder ``name``; ``config`` as for ``open_backend``), yielded,
    then closed and its platform undone."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        model_dir = tmp_path_factory.mktemp(name)
        yield open_backend(tree, model_dir, shape, mp.setattr, **config)
        close_backend()


# --------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    cached: int  # tokens of the request already in the TQ cache
    q: int  # tokens scheduled this step
    # A prefix-cache hit: (row, n) when the first n blocks of this request's
    # cached tokens are those of another row of the batch (the same physical
    # blocks, the same tokens).
    prefix: tuple[int, int] | None = None

    @property
    def seq(self) -> int:
        return self.cached + self.q

    def shared(self, block: int) -> int:
        """Cached tokens this request shares with its prefix row."""
        return 0 if self.prefix is None else self.prefix[1] * block

    def __repr__(self) -> str:
        hit = "" if self.prefix is None else f", prefix={self.prefix}"
        return f"Req({self.cached}, {self.q}{hit})"


@dataclass
class Batch:
    reqs: list[Req]
    query: torch.Tensor  # (N, hq * head), N with the padding tokens
    key: torch.Tensor  # (N, hk * head)
    value: torch.Tensor
    kv_cache: torch.Tensor  # as the runner hands it to the layer
    kv_slots: torch.Tensor  # the same bytes, (blocks, block, hk, slot)
    slot_mapping: torch.Tensor  # -1 for padding tokens
    k_raw: list[torch.Tensor]  # per request (seq, hk, head): all its keys
    v_raw: list[torch.Tensor]
    slots: list[torch.Tensor]  # per request (seq,): cache slot of each token
    cam: Any  # CommonAttentionMetadata as the runner passes it
    num_tokens: int  # real tokens (N without padding)
    soa: bool = False  # kv_slots holds turboquant_soa's pages (h.soa_pages)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_reqs(reqs: list[Req], block: int) -> None:
    """What the scheduler guarantees: decodes (one query) first; a prefix
    hit shares whole blocks that its prefix row has cached."""
    for i, r in enumerate(reqs):
        assert r.q >= 1 and r.cached >= 0, r
        if r.q == 1 and i:
            assert reqs[i - 1].q == 1, f"decodes first: {reqs}"
        if r.prefix is not None:
            p = reqs[r.prefix[0]]
            assert r.prefix[0] != i and p.prefix is None, f"{r}: prefix row {p}"
            assert 0 < r.shared(block) <= min(r.cached, p.cached), f"{r}, {p}"


def _block_tables(
    reqs: list[Req], block: int, g: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Each request's blocks at random physical ids (a prefix hit's first
    ones are its prefix row's), and the number of blocks in the cache."""
    need = [_cdiv(r.seq, block) for r in reqs]
    num_blocks = sum(n - r.shared(block) // block for n, r in zip(need, reqs)) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    for i in sorted(range(len(reqs)), key=lambda i: reqs[i].prefix is not None):
        r, shared = reqs[i], reqs[i].shared(block) // block
        if r.prefix is not None:
            table[i, :shared] = table[r.prefix[0], :shared]
        table[i, shared : need[i]] = torch.tensor(
            [ids.pop() for _ in range(need[i] - shared)], dtype=torch.int32
        )
    return table, num_blocks


def _kv(reqs: list[Req], shape: Shape, g: torch.Generator) -> tuple[list, list]:
    """Every request's raw K and V (a prefix hit's shared tokens are its
    prefix row's)."""
    k_raw, v_raw = [], []
    for r in reqs:
        k_raw.append(torch.randn(r.seq, shape.hk, shape.head, generator=g))
        v_raw.append(torch.randn(r.seq, shape.hk, shape.head, generator=g))
    for r, k, v in zip(reqs, k_raw, v_raw):
        n = r.shared(shape.block)
        if n:
            k[:n] = k_raw[r.prefix[0]][:n]
            v[:n] = v_raw[r.prefix[0]][:n]
    return [k.to(shape.dtype) for k in k_raw], [v.to(shape.dtype) for v in v_raw]


def write_context(
    kv_slots: torch.Tensor,
    slots: torch.Tensor,
    cfg: Any,
    g: torch.Generator,
    soa: bool = False,
) -> None:
    """Cached tokens as a store leaves them, written straight into their
    slots: random indices (FP8 keys: N(0, 1) in FP8), and key norms, value
    scales and zeros in the range the store kernel gives N(0, 1) inputs (in
    Triton's interpreter the store kernel is the dearest part of a long
    context)."""
    hk, width = kv_slots.shape[2:]
    n, head, vbits = slots.numel(), cfg.head_dim, cfg.effective_value_quant_bits
    if not n:
        return
    data = torch.randint(0, 256, (n, hk, width), dtype=torch.uint8, generator=g)

    def put(offset: int, values: torch.Tensor) -> None:
        fp16 = values.to(torch.float16).view(torch.uint8).reshape(n, hk, 2)
        data[..., offset : offset + 2] = fp16

    if cfg.key_fp8:
        keys = torch.randn(n, hk, head, generator=g).to(torch.float8_e4m3fn)
        data[..., :head] = keys.view(torch.uint8)
    else:
        norms = head**0.5 * (0.75 + torch.rand(n, hk, generator=g))
        put(cfg.key_packed_size - 2, norms)
    levels = 2**vbits - 1
    scale = (4 + 2 * torch.rand(n, hk, generator=g)) / levels
    val_bytes = math.ceil(head * vbits / 8)
    put(cfg.key_packed_size + val_bytes, scale)
    put(cfg.key_packed_size + val_bytes + 2, -scale * levels / 2)
    h.write_records(kv_slots, slots, data, cfg, soa)


def write_uq_context(
    kv_slots: torch.Tensor, slots: torch.Tensor, head: int, g: torch.Generator
) -> None:
    """Cached tokens as UltraQuant's store leaves them (its store kernel is
    the dearest part of a long context in Triton's interpreter): random FP4
    codes and UE8M0 group scales of 2^-2 and 2^-1, what the store gives
    N(0, 1) inputs (2^round(log2(0.156 * absmax)), absmax about 2 to 3)."""
    from vllm.v1.attention.ops.ultraquant import format as uqf

    hk, width = kv_slots.shape[2:]
    n = slots.numel()
    if not n:
        return
    data = torch.randint(0, 256, (n, hk, width), dtype=torch.uint8, generator=g)
    groups = uqf.n_groups(head)
    for off in (uqf.k_scales_offset(head), uqf.v_scales_offset(head)):
        scales = torch.randint(125, 127, (n, hk, groups), generator=g)
        data[..., off : off + groups] = scales.to(torch.uint8)
    block = kv_slots.shape[1]
    kv_slots[slots // block, slots % block] = data.to(kv_slots.device)


def _store_context(impl, layer, reqs, block, kv_cache, k_raw, v_raw, slots) -> None:
    """Earlier steps stored each request's cached tokens (a prefix hit's
    shared blocks once, by the row that computed them)."""
    own = [(i, r.shared(block), r.cached) for i, r in enumerate(reqs)]
    own = [(i, a, b) for i, a, b in own if b > a]
    if own:
        impl.do_kv_cache_update(
            layer,
            torch.cat([k_raw[i][a:b] for i, a, b in own]).to(DEVICE),
            torch.cat([v_raw[i][a:b] for i, a, b in own]).to(DEVICE),
            kv_cache,
            torch.cat([slots[i][a:b] for i, a, b in own]).to(DEVICE),
        )


def _step_inputs(reqs, k_raw, v_raw, slots, pad_tokens, shape, g):
    """The step's query, key, value and slot mapping (padding tokens: random
    inputs, slot -1)."""
    width = shape.hk * shape.head
    n = sum(r.q for r in reqs)
    key = torch.cat([k[r.cached :].reshape(r.q, width) for k, r in zip(k_raw, reqs)])
    value = torch.cat([v[r.cached :].reshape(r.q, width) for v, r in zip(v_raw, reqs)])
    slot_mapping = torch.cat([sl[r.cached :] for sl, r in zip(slots, reqs)])
    query = torch.randn(n + pad_tokens, shape.hq * shape.head, generator=g)
    pad_kv = torch.randn(2, pad_tokens, width, generator=g).to(shape.dtype)
    return (
        query.to(shape.dtype),
        torch.cat([key, pad_kv[0]]),
        torch.cat([value, pad_kv[1]]),
        torch.cat([slot_mapping, torch.full((pad_tokens,), -1)]),
    )


def make_batch(
    backend: Backend,
    impl: Any,
    layer: torch.nn.Module,
    reqs: list[Req],
    seed: int,
    optimistic: dict[int, int] | None = None,
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    store_context: bool = True,
) -> Batch:
    """A batch with its context already stored in a fresh TQ cache (by the
    tree's store kernel, or with ``store_context=False`` by ``write_context``).

    ``optimistic`` maps a row to drafts the CPU assumes accepted but the
    device knows were rejected (async spec decode): the host upper bound of
    seq_lens exceeds the device value there. Padding as the runner pads for
    CUDA graphs: ``pad_tokens`` more tokens (random inputs, slot -1) reach
    the cache update in every graph mode; for a FULL graph the attention
    metadata is padded too: ``pad_reqs`` rows with no query, no context and
    the null block, and the padding tokens counted as actual ones.
    """
    s = backend.shape
    check_reqs(reqs, s.block)
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = _block_tables(reqs, s.block, g)
    cache = h.new_tq_kv_cache(
        num_blocks, s.block, s.hk, s.head, s.preset, generator=g, device=DEVICE
    )
    slots = []
    for i, r in enumerate(reqs):
        pos = torch.arange(r.seq)
        slots.append(table[i, pos // s.block].long() * s.block + pos % s.block)
    k_raw, v_raw = _kv(reqs, s, g)
    if store_context:
        _store_context(impl, layer, reqs, s.block, cache.runner, k_raw, v_raw, slots)
    else:
        context = torch.cat(
            [sl[r.shared(s.block) : r.cached] for sl, r in zip(slots, reqs)]
        )
        if h.is_ultraquant(s.preset):
            write_uq_context(cache.slots, context, s.head, g)
        else:
            write_context(cache.slots, context, impl.tq_config, g, h.soa_pages(impl))
    query, key, value, slot_mapping = _step_inputs(
        reqs, k_raw, v_raw, slots, pad_tokens, s, g
    )
    table = torch.cat([table, torch.zeros(pad_reqs, table.shape[1], dtype=table.dtype)])
    cam = _cam(reqs, optimistic or {}, (pad_tokens, pad_reqs), table, slot_mapping)
    return Batch(
        reqs,
        query.to(DEVICE),
        key.to(DEVICE),
        value.to(DEVICE),
        cache.runner,
        cache.slots,
        slot_mapping.to(DEVICE),
        k_raw,
        v_raw,
        slots,
        cam,
        sum(r.q for r in reqs),
        h.soa_pages(impl),
    )


def _cam(reqs, optimistic, pad, table, slot_mapping) -> Any:
    """CommonAttentionMetadata as the runner builds it: query_start_loc
    padded non-decreasing, padding rows' seq_lens 0, ``num_actual_tokens``
    with the padding tokens when rows are padded, ``max_seq_len`` from the
    host upper bound."""
    pad_tokens, pad_reqs = pad
    qlens = [r.q for r in reqs] + [0] * pad_reqs
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    seq_lens = torch.tensor([r.seq for r in reqs] + [0] * pad_reqs, dtype=torch.int32)
    upper = seq_lens.clone()
    for i, extra in optimistic.items():
        upper[i] += extra
    return h.common_attn_metadata(
        query_start_loc=qsl.to(DEVICE, copy=True),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(DEVICE, copy=True),
        num_reqs=len(qlens),
        num_actual_tokens=int(qsl[-1]) + (pad_tokens if pad_reqs else 0),
        max_query_len=max(qlens),
        max_seq_len=int(upper.max()),
        block_table_tensor=table.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE, torch.int64),
        # As the runner (up to v0.29.0, which has the field): no exact CPU
        # seq_lens under async spec decode.
        _seq_lens_cpu=None if optimistic else seq_lens,
        seq_lens_cpu_upper_bound=upper,
    )


def capture_metadata(
    builder: Any, batch: Batch, watch: bool = False
) -> tuple[Any, Any]:
    """Metadata for capturing a full graph of ``batch``'s shape, built from
    what the runner's _dummy_run passes, and the CommonAttentionMetadata
    holding the device buffers that a replay refills in place.

    As in _dummy_run: a uniform batch of the graph's size, padding rows
    included: each row's query is the batch's max_query_len and its seq_len
    its q_len (host and device), max_seq_len is max_model_len, the block
    table holds the null block and the slots are -1 (no cache write).
    """
    cam = batch.cam
    num_reqs, q_len = cam.query_start_loc_cpu.shape[0] - 1, cam.max_query_len
    dummy = torch.full((num_reqs,), q_len, dtype=torch.int32)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    bufs = h.cam_replace(
        cam,
        query_start_loc=qsl.to(DEVICE),
        query_start_loc_cpu=qsl,
        num_actual_tokens=num_reqs * q_len,
        seq_lens=dummy.to(DEVICE, copy=True),
        block_table_tensor=torch.zeros_like(cam.block_table_tensor),
        slot_mapping=torch.full_like(cam.slot_mapping, -1),
        _seq_lens_cpu=dummy,
        seq_lens_cpu_upper_bound=dummy,
        max_seq_len=builder.vllm_config.model_config.max_model_len,
    )
    return builder.build_for_cudagraph_capture(watched(bufs) if watch else bufs), bufs


def refill(bufs: Any, batch: Batch) -> None:
    """What a replay changes: the contents of the device buffers."""
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        plain(getattr(bufs, name)).copy_(plain(getattr(batch.cam, name)))


def run_step(
    impl: Any, layer: torch.nn.Module, batch: Batch, meta: Any
) -> torch.Tensor:
    """One attention step as the runner does it: cache update, then forward;
    the output rows of the real tokens."""
    n = batch.query.shape[0]
    impl.do_kv_cache_update(
        layer, batch.key, batch.value, batch.kv_cache, meta.slot_mapping[:n]
    )
    return forward(impl, layer, batch, meta)[: batch.num_tokens]


def forward(impl: Any, layer: torch.nn.Module, batch: Batch, meta: Any) -> torch.Tensor:
    """The attention forward alone (the cache already updated): every row."""
    output = batch.query.new_empty(
        batch.query.shape[0], impl.num_heads * impl.head_size
    )
    impl.forward(
        layer, batch.query, batch.key, batch.value, batch.kv_cache, meta, output=output
    )
    return plain(output)


# --------------------------------------------------------------------------
# Decode steps and the decode kernels
# --------------------------------------------------------------------------


def decode_batch(
    backend: Backend, cached: list[int], seed: int
) -> tuple[Any, torch.nn.Module, Batch]:
    """A step of decodes after ``cached`` tokens (context written by
    ``write_context``), their new K/V stored by the tree's cache update:
    (impl, layer, batch)."""
    impl = backend.impl()
    layer = backend.layer(impl)
    reqs = [Req(c, 1) for c in cached]
    batch = make_batch(backend, impl, layer, reqs, seed, store_context=False)
    n = batch.num_tokens
    impl.do_kv_cache_update(
        layer, batch.key, batch.value, batch.kv_cache, batch.slot_mapping[:n]
    )
    return impl, layer, batch


def decode_kernels(
    impl: Any,
    layer: torch.nn.Module,
    batch: Batch,
    splits: int,
    pad: int = 0,
    old_splits: int | None = 32,
    grouped: bool = True,
    mid_o_buf: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """v0.33.0's TurboQuant decode kernel (``old_splits``: its default; None
    when not run) and the grouped one (``splits``; None when not ``grouped``;
    its stage 1's fp32 partials in ``mid_o_buf`` where given) on a decode
    batch's cache, with ``pad`` rows of no tokens appended (CUDA-graph
    padding): their (B + pad, Hq, D)."""
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )

    cam = batch.cam
    q = batch.query.view(-1, impl.num_heads, impl.head_size)
    q = torch.cat([q, torch.randn_like(q[:1]).expand(pad, -1, -1)])
    table = cam.block_table_tensor
    args = {
        "query": q,
        "kv_cache": batch.kv_slots,
        "block_table": torch.cat([table, table[:1].expand(pad, -1)]),
        "seq_lens": torch.cat([cam.seq_lens, cam.seq_lens.new_zeros(pad)]),
        **h.decode_params(layer, impl),
    }
    old = None
    if old_splits is not None:  # v0.33.0's kernel reads slots only
        slots = batch.kv_slots
        if batch.soa:
            slots = h.as_slots(slots, impl.tq_config)
        old = triton_turboquant_decode_attention(
            Pi=layer._tq_Pi, max_num_kv_splits=old_splits, **{**args, "kv_cache": slots}
        )
    if not grouped:
        return old, None
    from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
        triton_turboquant_grouped_decode_attention,
    )

    if batch.soa:
        args["soa_layout"] = True
    new = triton_turboquant_grouped_decode_attention(
        num_kv_splits=splits, mid_o_buf=mid_o_buf, **args
    )
    return old, new


class _Recorded:
    """A Triton kernel whose launches (``kernel[grid]``) are logged by name."""

    def __init__(self, kernel: Any, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: tuple) -> Any:
        self.log.append(self.name)
        return self.kernel[grid]


@contextlib.contextmanager
def stage1_launches() -> Iterator[list[str]]:
    """The grouped decode's stage-1 launches while open: "first", "regs"."""
    from vllm.v1.attention.ops import triton_turboquant_grouped_decode as gd

    log: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for attr, name in (("_tq_grouped_decode_stage1", "first"),
                           ("_tq_grouped_decode_regs_stage1", "regs")):  # fmt: skip
            mp.setattr(gd, attr, _Recorded(getattr(gd, attr), name, log))
        yield log


def check_regs_step(backend: Backend, many: bool = False) -> None:
    """A decode step's grouped decode (``decode_kernels``, two splits) and
    v0.33.0's kernel on the same cache, each against float64 attention over
    the K/V the cache holds: the registers stage 1 alone runs, and its
    largest error is at most 1.25x v0.33.0's (the decode accuracy suite's
    bound). ``many``: the grouped decode sees two SMs (``_many_programs``)."""
    from vllm.v1.attention.ops import triton_turboquant_grouped_decode as gd

    impl, layer, batch = decode_batch(backend, [200, 77, 16], seed=12)
    want = torch.cat(reference(batch, impl, layer))
    with pytest.MonkeyPatch.context() as mp, stage1_launches() as log:
        if many:
            mp.setattr(gd, "_num_sms", lambda device: 2)
        old, new = decode_kernels(impl, layer, batch, splits=2)
    err, old_err = ((x.double().cpu().view_as(want) - want).abs().max().item()
                    for x in (new, old))  # fmt: skip
    assert log == ["regs"], f"stage-1 launches: {log}"
    assert err <= 1.25 * old_err, f"max |error| {err:.3g}, v0.33.0's {old_err:.3g}"


def env_cases(shapes: list[tuple[str, torch.dtype]]) -> pytest.MarkDecorator:
    """A test once for each (preset, query dtype) of ``shapes``, given to its
    module's ``env`` fixture as ``request.param``."""
    ids = [f"{p.removeprefix('turboquant_')}-{str(d)[6:]}" for p, d in shapes]
    return pytest.mark.parametrize("env", shapes, ids=ids, indirect=True)


def cases_fixture(name: str, hq: int, hk: int, head: int) -> Any:
    """A module's ``env`` fixture for ``env_cases``: the tree's backend with
    ``hq`` query and ``hk`` KV heads of size ``head``, for each (preset,
    query dtype). Use: ``env = tb.cases_fixture("name", hq=8, hk=2, head=64)``."""

    def env(
        request: pytest.FixtureRequest, vllm_tree: Path, tmp_path_factory: Any
    ) -> Iterator[Backend]:
        preset, dtype = request.param
        shape = Shape(hq=hq, hk=hk, head=head, preset=preset, dtype=dtype)
        folder = f"{name}_{preset}_{str(dtype)[6:]}"
        yield from backend_fixture(vllm_tree, tmp_path_factory, shape, folder)

    return pytest.fixture(scope="module", name="env")(env)


def slot_twin(
    backend: Backend, reqs: list[Req]
) -> tuple[Any, Any, Batch, torch.Tensor]:
    """A batch whose context the backend stored, and the same K/V stored by
    v0.33.0's slot store into a cache of slots: (impl, layer, batch, slots)."""
    from vllm.v1.attention.ops.triton_turboquant_store import (
        triton_turboquant_store,
    )

    impl = backend.impl()
    layer = backend.layer(impl)
    batch = make_batch(backend, impl, layer, reqs, seed=11)
    s, cfg = backend.shape, impl.tq_config
    slots = h.new_tq_kv_cache(
        batch.kv_slots.shape[0], s.block, s.hk, s.head, s.preset,
        generator=torch.Generator().manual_seed(1), device=DEVICE,
    ).slots  # fmt: skip
    own = [(sl[: r.cached], k[: r.cached], v[: r.cached])
           for sl, k, v, r in zip(batch.slots, batch.k_raw, batch.v_raw, reqs)]  # fmt: skip
    triton_turboquant_store(
        torch.cat([k for _, k, _ in own]).to(DEVICE),
        torch.cat([v for _, _, v in own]).to(DEVICE),
        slots,
        torch.cat([sl for sl, _, _ in own]).to(DEVICE, torch.int32),
        layer._tq_PiT,
        layer._tq_midpoints,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
    )
    return impl, layer, batch, slots


def page_layout(
    batch: Batch, slots: torch.Tensor, cfg: Any, reqs: list[Req]
) -> str | None:
    """Which layout's offsets read the slot store's records (``slot_twin``)
    back from the batch's pages: "soa", "slots" or None."""
    ids = torch.cat([sl[: r.cached] for sl, r in zip(batch.slots, reqs)])
    want = h.read_records(slots, ids, cfg, soa=False)
    for name, soa in (("soa", True), ("slots", False)):
        if torch.equal(h.read_records(batch.kv_slots, ids, cfg, soa), want):
            return name
    return None


def decode_step(env: Backend) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """A decode step of three requests through the backend's forward: the
    stage-1 kernels it launched, its output and the float64 reference."""
    impl, layer, batch = decode_batch(env, [200, 77, 16], seed=12)
    meta = env.builder().build(0, batch.cam)
    with stage1_launches() as log:
        out = forward(impl, layer, batch, meta)
    want = torch.cat(reference(batch, impl, layer))
    return log, plain(out).double().cpu()[: want.shape[0]], want


# One-warp programs of the registers stage 1 a SM under its register cap of
# 168 (64K registers), from tq-v0.33/0020.
REGS_RESIDENT = 12


def step_splits(
    gd: Any, requests: int, kv_heads: int, in_registers: bool = True
) -> int:
    """The grouped decode's split count (module ``gd``) for a decode step of
    ``requests`` as the backend asks it (max_num_seqs 256, 32 splits
    reserved each)."""
    budget = 256 * 32 // requests
    return gd.grouped_decode_num_splits(
        requests, kv_heads, budget, DEVICE, in_registers
    )


def half_ulp(dtype: torch.dtype, x: torch.Tensor) -> float:
    """Half the spacing of ``dtype`` at the largest |x|: the largest error of
    a correctly rounded output."""
    top = max(x.abs().max().item(), 1e-30)
    return 0.5 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))


# --------------------------------------------------------------------------
# Independent float64 reference
# --------------------------------------------------------------------------


def _hadamard(d: int) -> torch.Tensor:
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < d:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m / math.sqrt(d)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dim (2 bytes) of a uint8 tensor."""
    return b.contiguous().view(torch.float16).squeeze(-1).double()


def _unpack(b: torch.Tensor, base: int, bits: int, head: int) -> torch.Tensor:
    """``head`` little-endian ``bits``-bit indices packed from byte ``base``."""
    off = torch.arange(head) * bits
    word = b[..., base + off // 8] | (b[..., base + off // 8 + 1] << 8)
    return (word >> (off % 8)) & ((1 << bits) - 1)


def dequant(
    kv_slots: torch.Tensor,
    slots: torch.Tensor,
    cfg: Any,
    centroids: torch.Tensor,
    soa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (len, hk, head) float64 from the TQ slot bytes, in PyTorch
    (``soa``: from turboquant_soa's pages, ``h.read_records``).

    Slot layout (per head and position): [MSE key indices | key norm fp16 |
    value indices | value scale fp16 | value zero fp16], keys in the
    Hadamard-rotated basis; or [FP8 (E4M3) key | value ...], keys as they are.
    """
    head = cfg.head_dim
    raw = h.read_records(plain(kv_slots), slots, cfg, soa)
    b = raw.to(torch.int64)
    if cfg.key_fp8:
        k = raw[..., :head].contiguous().view(torch.float8_e4m3fn).double()
    else:
        bits = cfg.key_mse_bits
        mse_bytes = math.ceil(head * bits / 8)
        c = centroids.double().cpu()[_unpack(b, 0, bits, head)]
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        k = _f16(raw[..., mse_bytes : mse_bytes + 2]).unsqueeze(-1) * c
        k = k @ _hadamard(head)  # back from the rotated basis (H = H^T = H^-1)

    vb = cfg.key_packed_size
    vbits = cfg.effective_value_quant_bits
    val_bytes = math.ceil(head * vbits / 8)
    vidx = _unpack(b, vb, vbits, head).double()
    scale = _f16(raw[..., vb + val_bytes : vb + val_bytes + 2]).unsqueeze(-1)
    zero = _f16(raw[..., vb + val_bytes + 2 : vb + val_bytes + 4]).unsqueeze(-1)
    return k, vidx * scale + zero


# FP4 E2M1: sign bit, then 2 exponent bits and 1 mantissa bit.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def uq_dequant(
    kv_slots: torch.Tensor, slots: torch.Tensor, head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (len, hk, head) float64 from UltraQuant's slot bytes, in
    PyTorch, K in the model's basis.

    Slot layout (per head and position): [K codes | K scales | V codes | V
    scales]: FP4 E2M1 nibbles, element 2i in the low nibble of byte i, and
    one UE8M0 byte (2^(e - 127), 0 for zero) per group of 32; keys
    Hadamard-rotated.
    """
    hk = kv_slots.shape[2]
    raw = plain(kv_slots).cpu().reshape(-1, hk, kv_slots.shape[-1])[slots.cpu()]
    b = raw.to(torch.int64)
    lut = torch.tensor([*_FP4, *(-x for x in _FP4)], dtype=torch.float64)
    groups = head // 32

    def part(base: int) -> torch.Tensor:
        codes = b[..., base : base + head // 2]
        nibbles = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
        e = b[..., base + head // 2 : base + head // 2 + groups].double()
        scale = torch.where(e == 0, 0.0, torch.exp2(e - 127))
        values = lut[nibbles].unflatten(-1, (groups, 32)) * scale.unsqueeze(-1)
        return values.flatten(-2)

    k = part(0) @ _hadamard(head)  # back from the rotated basis
    return k, part(head // 2 + groups)


def uq_query(q: torch.Tensor) -> torch.Tensor:
    """What UltraQuant's Triton kernel (decodes, small continuations)
    attends with: the query rotated in fp32 and rounded to FP8 E4M3 (its
    format's definition), returned in the model's basis (float64)."""
    hadamard = _hadamard(q.shape[-1])
    rotated = (q.float() @ hadamard.float()).to(torch.float8_e4m3fn)
    return rotated.double() @ hadamard


def threshold(impl: Any) -> int:
    """The continuation threshold of the impl's module (a test may lower
    it to keep Triton's interpreter affordable)."""
    module = sys.modules[type(impl).__module__]
    return getattr(module, "_CONTINUATION_DECODE_THRESHOLD", THRESHOLD)


def row_paths(reqs: list[Req], threshold: int = THRESHOLD) -> list[str]:
    """What each row's own new tokens are read as, as TurboQuant defines it:
    ``cache`` (decodes and continuation chunks of at most ``threshold``
    queries go through the decode kernel, after their tokens were stored) or
    ``raw`` (first chunks, and larger continuation chunks: the cached
    context dequantized, the chunk's own K/V as computed). Only (cached, q)
    decide: never the rest of the batch."""
    return [
        "raw" if r.q > 1 and (r.cached == 0 or r.q > threshold) else "cache"
        for r in reqs
    ]


def attend(q, k, v, first_pos: int, scale: float) -> torch.Tensor:
    """Causal attention in float64: queries at positions first_pos, ...;
    q (n, hq, d), k/v (len, hk, d) with GQA."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    pos_q = torch.arange(q.shape[0]).unsqueeze(1) + first_pos
    mask = torch.arange(k.shape[0]).unsqueeze(0) <= pos_q
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def row_kv(batch: Batch, i: int, impl: Any, layer: torch.nn.Module, path: str):
    """K/V (seq, hk, head) float64 that row ``i`` must attend to: the cache
    as it holds them after the step's store, the row's own new tokens raw
    on the ``raw`` path."""
    r = batch.reqs[i]
    if h.is_ultraquant(impl.kv_cache_dtype):
        k, v = uq_dequant(batch.kv_slots, batch.slots[i], impl.head_size)
    else:
        centroids = plain(layer._tq_centroids)
        k, v = dequant(
            batch.kv_slots, batch.slots[i], impl.tq_config, centroids, batch.soa
        )
    if path == "raw":
        k[r.cached :] = batch.k_raw[i][r.cached :].double()
        v[r.cached :] = batch.v_raw[i][r.cached :].double()
    return k, v


def reference(batch: Batch, impl: Any, layer: torch.nn.Module) -> list[torch.Tensor]:
    """Each request's expected output rows (q, hq * head), float64."""
    head = impl.head_size
    q_all = plain(batch.query).cpu().double().reshape(-1, impl.num_heads, head)
    out, start = [], 0
    paths = row_paths(batch.reqs, threshold(impl))
    for i, (r, path) in enumerate(zip(batch.reqs, paths)):
        k, v = row_kv(batch, i, impl, layer, path)
        q = q_all[start : start + r.q]
        start += r.q
        if path == "cache" and h.is_ultraquant(impl.kv_cache_dtype):
            q = uq_query(q)
        out.append(attend(q, k, v, r.cached, impl.scale).reshape(r.q, -1))
    return out


def rows(out: torch.Tensor, reqs: list[Req]) -> list[torch.Tensor]:
    """The output split into each request's rows (float64, on CPU)."""
    got = plain(out).cpu().double()
    return list(torch.split(got[: sum(r.q for r in reqs)], [r.q for r in reqs]))


# Largest |out - reference| of a row, for outputs rounded to fp16: TurboQuant
# computes in fp32 from the very bytes the reference reads back (so the
# quantizer's own error is not part of it), and rounds the output, and on
# the first-chunk path its scores, to fp16 (relative 2^-11); |out| <= max|V|,
# a few units for the tests' N(0, 1) inputs. Measured: at most 2.4e-3 over
# the differential test's long mode (test_tq_batches.py, 100 examples a test,
# both patched stacks, on an H200: ci/gpu/run.sh batches).
TOLERANCE = 2e-2
# Rounded to bf16 (relative 2^-8): UltraQuant's outputs, its rotated queries
# on the dequantize-and-attend paths and the softmax weights of its Triton
# kernel (whatever the model's dtype), and TurboQuant's with a bf16 model
# (its continuation dequantizes the context to bf16). Measured: at most
# 0.028 over test_uq_attention.py and test_uq_workspace.py, 0.027 over
# test_tq_batches.py's bf16 shapes (long mode, 60 examples a test, on an H100:
# ci/gpu/results/batches-2026-11-28/); the bugs they catch are off by 2.8 or
# more.
BF16_TOLERANCE = 6e-2


def tolerance(impl: Any, dtype: torch.dtype = torch.float16) -> float:
    """The tolerance of ``impl``'s outputs for a model of ``dtype``."""
    bf16 = h.is_ultraquant(impl.kv_cache_dtype) or dtype == torch.bfloat16
    return BF16_TOLERANCE if bf16 else TOLERANCE


def assert_matches_reference(
    got: torch.Tensor, batch: Batch, impl: Any, layer: torch.nn.Module
) -> None:
    """Every row within ``tolerance`` of the reference (for hand-picked batches;
    the differential test reports per request)."""
    want = torch.cat(reference(batch, impl, layer))
    got64 = plain(got).cpu().double()[: want.shape[0]]
    err = (got64 - want).abs().max().item()
    assert torch.isfinite(got64).all()
    assert err < tolerance(impl, got.dtype), f"max |out - ref| = {err:.3g}"


def own_tokens_only(batch: Batch, i: int, impl: Any) -> torch.Tensor:
    """Row ``i`` attending to its own new tokens alone, as a first chunk
    (the #46460 symptom)."""
    r = batch.reqs[i]
    start = sum(x.q for x in batch.reqs[:i])
    q = plain(batch.query).cpu().double()[start : start + r.q]
    k = batch.k_raw[i][r.cached :].double()
    v = batch.v_raw[i][r.cached :].double()
    q = q.reshape(r.q, impl.num_heads, impl.head_size)
    return attend(q, k, v, 0, impl.scale).reshape(r.q, -1)


WORST = {"error": 0.0}  # the largest error of a row check_rows passed


def check_rows(out: torch.Tensor, batch: Batch, impl: Any, layer: Any) -> None:
    """Every request's rows against the reference; the first wrong one is
    reported with its batch and what it did, where that can be told."""
    want = reference(batch, impl, layer)
    tol = tolerance(impl, out.dtype)
    for i, (got, ref) in enumerate(zip(rows(out, batch.reqs), want)):
        err = (got - ref).abs().max().item() if got.isfinite().all() else float("inf")
        if err <= tol:
            WORST["error"] = max(WORST["error"], err)
            continue
        r = batch.reqs[i]
        what = "differs from the reference"
        if r.cached and (got - own_tokens_only(batch, i, impl)).abs().max() <= tol:
            what = (
                f"ignores its cached context (attends to its own {r.q} new tokens only)"
            )
        raise AssertionError(
            f"request {i} {r!r} of batch {batch.reqs}: {what}: max |out - "
            f"reference| = {err:.3g} > {tol}"
        )


# --------------------------------------------------------------------------
# The runner's modes: flash-attn or not, full graphs, async scheduling
# --------------------------------------------------------------------------


def use_attention(mode: str, backend: Backend, setattr: Any) -> str:
    """The backend's flash-attn code paths on (``"flash-attn"``) or off
    (``"no-flash-attn"``). Where the tree has no vLLM flash-attn (CPU), a
    float64 stand-in (``tqharness.ReferenceFlashAttn``) takes the kernel's
    place. ``setattr``: a monkeypatch's."""
    tq = backend.tq
    if mode == "no-flash-attn":
        for module in backend.modules:
            setattr(module, "_HAS_FLASH_ATTN", False)
    elif not tq._HAS_FLASH_ATTN:
        for module in backend.modules:
            setattr(module, "_HAS_FLASH_ATTN", True)
        setattr(tq, "flash_attn_varlen_func", h.ReferenceFlashAttn(), raising=False)
    return mode


def new_impl(backend: Backend, attention: str) -> tuple[Any, Any]:
    """A fresh impl and its layer state, for ``use_attention``'s mode."""
    impl = backend.impl()
    if attention == "flash-attn" and isinstance(
        backend.tq.flash_attn_varlen_func, h.ReferenceFlashAttn
    ):
        impl.fa_version = None  # the stand-in takes no version
    return impl, backend.layer(impl)


def check_replay(
    backend: Backend,
    impl: Any,
    layer: torch.nn.Module,
    real: Batch,
    pad: int,
    exact: Batch | None = None,
) -> None:
    """A full graph of ``real``'s shape (``pad`` padding rows): metadata
    for its capture built from the runner's dummy values, run with the
    device tensors unreadable on the host, then, as a replay does, the
    device buffers refilled with ``real``, the step's metadata built (the
    runner builds it before every replay) and the graph run again with the
    capture-time host values. It must equal an eager step (of ``exact``
    where given: ``real`` with async host upper bounds) bit for bit
    (TurboQuant) or within the tolerance (UltraQuant: its Triton kernel
    picks its 2D or split-KV launch by the host max_seq_len, the capture's
    max_model_len or a step's own, which round differently), and be right."""
    builder = backend.builder()
    captured, bufs = capture_metadata(builder, real, watch=True)
    run_step(impl, layer, real, captured)  # the capture: dummy contents
    refill(bufs, real)
    builder.build(0, real.cam)
    replayed = run_step(impl, layer, real, captured)
    exact = exact or real
    eager = run_step(impl, layer, exact, builder.build(0, exact.cam))
    diff = (replayed.double() - eager.double()).abs().max().item()
    bitwise = not h.is_ultraquant(impl.kv_cache_dtype)
    tol = tolerance(impl, replayed.dtype)
    if not (torch.equal(replayed, eager) if bitwise else diff <= tol):
        over = "" if exact is real else " (host seq_lens upper bounds)"
        raise AssertionError(
            f"replay differs from eager: batch {real.reqs} with {pad} padding "
            f"rows{over}: max |replay - eager| = {diff:.3g}"
        )
    check_rows(replayed, real, impl, layer)


def check_async(
    backend: Backend,
    impl: Any,
    layer: torch.nn.Module,
    reqs: list[Req],
    over: dict[int, int],
    seed: int,
) -> None:
    """Async spec decode: the host knows an upper bound of some rows'
    seq_lens (``over``: rejected drafts per row). The output must equal the
    one with exact host seq_lens bit for bit, and be right."""
    builder = backend.builder()
    exact = make_batch(backend, impl, layer, reqs, seed, store_context=False)
    want = run_step(impl, layer, exact, builder.build(0, exact.cam))
    optimistic = make_batch(
        backend, impl, layer, reqs, seed, optimistic=over, store_context=False
    )
    got = run_step(impl, layer, optimistic, builder.build(0, optimistic.cam))
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(
            "continuation seq_lens follow the host upper bound: batch "
            f"{reqs}, host seq_lens over by {over}: the output differs from "
            f"the one with exact host seq_lens by {diff:.3g}"
        )
    check_rows(got, optimistic, impl, layer)
