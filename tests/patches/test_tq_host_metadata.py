"""Targeted tests of tq/0002: TurboQuant attention reads no device tensor on
the host (vllm issue 40807).

In v0.20.2 ``TurboQuantAttentionImpl`` turns ``query_start_loc`` and
``seq_lens`` into Python lists inside the attention op (``.tolist()`` in
``_prefill_attention`` and in ``forward()``'s mixed-batch branch): a
device-to-host sync every step, and a crash under CUDA graph capture. The
patch has the metadata builder carry host copies taken from the CPU tensors
the runner already has.

How the tests see a host read on a CPU-only machine: the metadata's device
tensors (``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping``) are wrapped in ``DeviceOnly``, a tensor subclass whose
host reads (``tolist``, ``item``, ``cpu``, ``numpy``, ``int()``,
``bool()``, ``float()``, ``__index__``, ``__array__``, ``equal``, the
data-dependent-shape ops ``nonzero``/``masked_select``/``unique``, printing,
``.to("cpu")``) raise ``HostReadError`` when the nearest caller outside
torch is a file of the vLLM tree under test. Values derived from them (a
slice, ``seq_lens[i:i+1] + offsets``) stay wrapped. Kernel launches are not
host reads: Triton's interpreter reads the data to emulate the device, and
its frames are not vLLM's, so it passes; so do the tests' own reads. On a GPU
the same tests run on CUDA tensors; a real ``torch.cuda.graph`` capture and
``torch.cuda.set_sync_debug_mode("error")`` are left to the GPU script.

Numbers are checked against an independent float64 reference: attention
written out in PyTorch over K/V that this module dequantizes from the raw
cache bytes itself (not with vLLM's kernels).

The tests run on every release from v0.20.0 on (``tqharness`` finds each
tree's API by probing it): a real ``VllmConfig`` from ``EngineArgs`` for a
tiny local model, the KV cache spec of a real TurboQuant ``Attention``
layer, the cache laid out as that tree's runner lays it out, and
``CommonAttentionMetadata`` with the fields the tree has. Upstream fixed the
host reads of #40807 in v0.21.0 (the builder passes the runner's CPU tensors,
vllm#41434), so ``test_forward_reads_no_device_tensor`` passes there; but it
freezes host ints where device values are needed, which
``test_capture_metadata_replays_context_aware_path`` (full-graph capture
records the first-chunk branch) and
``test_async_spec_decode_optimistic_host_seq_lens`` (causal lengths from the
optimistic CPU upper bound) show on every release since: both carry bug
signatures of their own.

``VLLM_BASE_TREE`` (optional): a vLLM tree without this patch (the series
position below it, e.g. the v0.20.2 base). When set,
``test_outputs_bit_exact_vs_unpatched`` loads that tree's
``turboquant_attn.py`` next to the patched one and requires bit-identical
outputs; it is skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import tqharness as h
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TQ_MODULE = h.TQ_MODULE
TQ_PATH = Path("vllm/v1/attention/backends/turboquant_attn.py")

# Small shapes: on CPU every Triton kernel runs in the interpreter.
HQ, HK, HEAD, BLOCK = 2, 1, 32, 16
PRESET = "turboquant_4bit_nc"
DTYPE = torch.float16
# Queries in one continuation chunk above which v0.20.2 leaves the decode
# kernel for the dequant + attention path (_CONTINUATION_DECODE_THRESHOLD).
THRESHOLD = 128
# Longer than any request here; a full-graph capture's max_seq_len.
MAX_MODEL_LEN = 512

# How each bug shows (see the tests' docstrings).
HOST_READ = r"^host read \S+ of a device tensor of the attention metadata"
REPLAY_DIFFERS = r"^replay differs from eager"
HOST_UPPER_BOUND = r"^continuation seq_lens follow the host upper bound"


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
_vllm_dir: str | None = None  # set by the `env` fixture


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


# --------------------------------------------------------------------------
# Environment: the vLLM modules, a config, an impl, a layer
# --------------------------------------------------------------------------


class Env(SimpleNamespace):
    def __repr__(self) -> str:  # keep hypothesis' failure reports short
        return "Env()"


@pytest.fixture(scope="module")
def env(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SimpleNamespace]:
    global _vllm_dir
    with pytest.MonkeyPatch.context() as mp:
        h.install_platform(vllm_tree, mp.setattr)
        from vllm.v1.worker import workspace

        tq = importlib.import_module(TQ_MODULE)
        h.inspect_models_in_process(mp)
        # A real config: the builder (v0.24.0+) and the impl (v0.28.0+) read
        # the model, scheduler and attention configs.
        model_dir = h.write_tiny_model(
            tmp_path_factory.mktemp("tiny_qwen3"),
            num_heads=HQ,
            num_kv_heads=HK,
            head_dim=HEAD,
        )
        config = h.make_vllm_config(
            model_dir, preset=PRESET, block_size=BLOCK, max_model_len=MAX_MODEL_LEN
        )
        _vllm_dir = str((vllm_tree / "vllm").resolve()) + os.sep
        # As the model runner does, the workspace manager exists before any
        # attention layer is built: continuation prefill takes its dequant
        # buffers from it in later releases (v0.21.0+) and with tq/0001.
        workspace.init_workspace_manager(DEVICE)
        # The layer the builder serves, for its KV cache spec.
        attn = h.build_tq_attention(config, HQ, HEAD, HK)
        spec = h.runner_kv_cache_spec(attn, config)
        assert h.is_turboquant_spec(spec) and spec.block_size == BLOCK
        yield Env(
            tq=tq, config=config, spec=spec, layer_name=attn.layer_name, tree=vllm_tree
        )
        workspace.reset_workspace_manager()
        _vllm_dir = None


def make_impl(env: SimpleNamespace, tq: Any = None, preset: str = PRESET) -> Any:
    return h.tq_impl(env.config, HQ, HEAD, HK, preset, tq or env.tq)


def make_layer(env: SimpleNamespace, impl: Any) -> torch.nn.Module:
    return h.centroids_layer(impl, HEAD, DEVICE)


def make_builder(env: SimpleNamespace, tq: Any = None) -> Any:
    return h.tq_builder(env.config, env.spec, [env.layer_name], DEVICE, tq or env.tq)


# --------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    cached: int  # tokens of the request already in the TQ cache
    q: int  # tokens scheduled this step

    @property
    def seq(self) -> int:
        return self.cached + self.q


SCENARIOS: dict[str, list[Req]] = {
    # Prompts' first chunks: nothing cached yet.
    "first_chunk": [Req(0, 5), Req(0, 3)],
    # Chunked prefill, chunks of <= 128 queries: the decode-kernel branch.
    "small_continuation": [Req(13, 3), Req(6, 2)],
    # A chunk of > 128 queries: the dequant + attention branch.
    "large_continuation": [Req(10, THRESHOLD + 2)],
    # Decodes first, then a first chunk and a continuation chunk.
    "mixed": [Req(9, 1), Req(12, 1), Req(0, 4), Req(7, 3)],
    # Spec-decode verification, q_len = 1 + 2 drafts, decodes first, then a
    # chunked prefill (TurboQuant treats q_len > 1 as prefill rows).
    "spec_decode": [Req(9, 3), Req(12, 3), Req(5, 3), Req(8, 4)],
}
# Uniform spec-decode batch (one draft token: the interpreter runs the decode
# kernel per query row), the shape the runner captures full CUDA graphs of.
CAPTURE_BATCH = [Req(7, 2), Req(10, 2)]


@dataclass
class Batch:
    reqs: list[Req]
    query: torch.Tensor  # (N, HQ * HEAD)
    key: torch.Tensor  # (N, HK * HEAD)
    value: torch.Tensor
    kv_cache: torch.Tensor  # as the runner hands it to the layer
    kv_slots: torch.Tensor  # the same bytes, (blocks, BLOCK, HK, slot)
    slot_mapping: torch.Tensor
    k_raw: list[torch.Tensor]  # per request (seq, HK, HEAD): all its keys
    v_raw: list[torch.Tensor]
    slots: list[torch.Tensor]  # per request (seq,): cache slot of each token
    cam: Any


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(
    env: SimpleNamespace,
    impl: Any,
    layer: torch.nn.Module,
    reqs: list[Req],
    seed: int,
    optimistic: dict[int, int] | None = None,
) -> Batch:
    """A batch with its context already stored in a fresh TQ cache.

    The cache starts as random bytes, so reading a slot nobody wrote shows
    up as garbage. ``optimistic`` maps request index to drafts the CPU
    assumes accepted but the device knows were rejected (async spec decode):
    the CPU upper bound of seq_lens exceeds the device value there.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [_cdiv(r.seq, BLOCK) for r in reqs]
    num_blocks = sum(blocks_per_req) + 2
    cache = h.new_tq_kv_cache(
        num_blocks, BLOCK, HK, HEAD, PRESET, generator=g, device=DEVICE
    )
    kv_cache = cache.runner
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_req)
    block_table = torch.zeros(len(reqs), width, dtype=torch.int32)
    k_raw, v_raw, slots = [], [], []
    for i, (r, nb) in enumerate(zip(reqs, blocks_per_req, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        block_table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(r.seq)
        slots.append(block_table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
        k_raw.append(torch.randn(r.seq, HK, HEAD, generator=g).to(DTYPE))
        v_raw.append(torch.randn(r.seq, HK, HEAD, generator=g).to(DTYPE))

    # Earlier steps stored the context.
    ctx = [i for i, r in enumerate(reqs) if r.cached]
    if ctx:
        impl.do_kv_cache_update(
            layer,
            torch.cat([k_raw[i][: reqs[i].cached] for i in ctx]).to(DEVICE),
            torch.cat([v_raw[i][: reqs[i].cached] for i in ctx]).to(DEVICE),
            kv_cache,
            torch.cat([slots[i][: reqs[i].cached] for i in ctx]).to(DEVICE),
        )

    n = sum(r.q for r in reqs)
    key = torch.cat([k[r.cached :] for k, r in zip(k_raw, reqs, strict=True)])
    value = torch.cat([v[r.cached :] for v, r in zip(v_raw, reqs, strict=True)])
    slot_mapping = torch.cat([s[r.cached :] for s, r in zip(slots, reqs, strict=True)])
    query = torch.randn(n, HQ * HEAD, generator=g).to(DTYPE)

    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([r.q for r in reqs]), 0)
    seq_lens = torch.tensor([r.seq for r in reqs], dtype=torch.int32)
    upper = seq_lens.clone()
    for i, extra in (optimistic or {}).items():
        upper[i] += extra
    cam = h.common_attn_metadata(
        query_start_loc=qsl.to(DEVICE, copy=True),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(DEVICE, copy=True),
        num_reqs=len(reqs),
        num_actual_tokens=n,
        max_query_len=max(r.q for r in reqs),
        max_seq_len=int(upper.max()),
        block_table_tensor=block_table.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE, torch.int64),
        # As the runner (up to v0.29.0, which has the field): no exact CPU
        # seq_lens under async spec decode.
        _seq_lens_cpu=None if optimistic else seq_lens,
        seq_lens_cpu_upper_bound=upper,
    )
    return Batch(
        reqs,
        query.to(DEVICE),
        key.reshape(n, -1).to(DEVICE),
        value.reshape(n, -1).to(DEVICE),
        kv_cache,
        cache.slots,
        slot_mapping.to(DEVICE, torch.int64),
        k_raw,
        v_raw,
        slots,
        cam,
    )


def watched(cam: Any) -> Any:
    """The same metadata with its device tensors wrapped by the detector."""
    return h.cam_replace(
        cam,
        query_start_loc=device_only(cam.query_start_loc),
        seq_lens=device_only(cam.seq_lens),
        block_table_tensor=device_only(cam.block_table_tensor),
        slot_mapping=device_only(cam.slot_mapping),
    )


def capture_metadata(
    builder: Any, batch: Batch, watch: bool = False
) -> tuple[Any, Any]:
    """Metadata for capturing a full graph of ``batch``'s shape, built from
    what the runner's _dummy_run passes, and the CommonAttentionMetadata
    holding the device buffers that a replay refills in place.

    As in _dummy_run: each row's seq_len is its q_len (host and device),
    max_seq_len is max_model_len, the block table holds the null block and
    the slots are -1 (no cache write).
    """
    cam = batch.cam
    dummy = torch.tensor([r.q for r in batch.reqs], dtype=torch.int32)
    bufs = h.cam_replace(
        cam,
        query_start_loc=cam.query_start_loc.clone(),
        seq_lens=dummy.to(DEVICE, copy=True),
        block_table_tensor=torch.zeros_like(cam.block_table_tensor),
        slot_mapping=torch.full_like(cam.slot_mapping, -1),
        _seq_lens_cpu=dummy,
        seq_lens_cpu_upper_bound=dummy,
        max_seq_len=MAX_MODEL_LEN,
    )
    return builder.build_for_cudagraph_capture(watched(bufs) if watch else bufs), bufs


def run_step(
    impl: Any, layer: torch.nn.Module, batch: Batch, meta: Any
) -> torch.Tensor:
    """One attention step as the runner does it: cache update, then forward."""
    n = batch.query.shape[0]
    impl.do_kv_cache_update(
        layer, batch.key, batch.value, batch.kv_cache, meta.slot_mapping[:n]
    )
    output = torch.empty(n, HQ * HEAD, dtype=DTYPE, device=DEVICE)
    impl.forward(
        layer, batch.query, batch.key, batch.value, batch.kv_cache, meta, output=output
    )
    return plain(output)


# --------------------------------------------------------------------------
# Independent float64 reference
# --------------------------------------------------------------------------


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last dim (2 bytes) of a uint8 tensor."""
    return b.contiguous().view(torch.float16).squeeze(-1).double()


def dequant(
    kv_slots: torch.Tensor, slots: torch.Tensor, cfg: Any, centroids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (len, HK, HEAD) float64 from the TQ slot bytes, in PyTorch.

    Slot layout (per head and position): [MSE key indices | key norm fp16 |
    value indices | value scale fp16 | value zero fp16], keys in the
    Hadamard-rotated basis.
    """
    raw = plain(kv_slots).cpu().reshape(-1, HK, kv_slots.shape[-1])[slots.cpu()]
    b = raw.to(torch.int64)
    d = torch.arange(HEAD)
    assert not cfg.key_fp8, "reference covers MSE-key presets"
    bits = cfg.key_mse_bits
    mse_bytes = math.ceil(HEAD * bits / 8)
    off = d * bits
    word = b[..., off // 8] | (b[..., off // 8 + 1] << 8)
    idx = (word >> (off % 8)) & ((1 << bits) - 1)
    c = centroids.double().cpu()[idx]
    if cfg.norm_correction:
        c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
    k = _f16(raw[..., mse_bytes : mse_bytes + 2]).unsqueeze(-1) * c
    k = k @ _hadamard(HEAD)  # back from the rotated basis (H = H^T = H^-1)

    vb = cfg.key_packed_size
    vbits = cfg.effective_value_quant_bits
    val_bytes = math.ceil(HEAD * vbits / 8)
    voff = d * vbits
    vword = b[..., vb + voff // 8] | (b[..., vb + voff // 8 + 1] << 8)
    vidx = ((vword >> (voff % 8)) & ((1 << vbits) - 1)).double()
    scale = _f16(raw[..., vb + val_bytes : vb + val_bytes + 2]).unsqueeze(-1)
    zero = _f16(raw[..., vb + val_bytes + 2 : vb + val_bytes + 4]).unsqueeze(-1)
    return k, vidx * scale + zero


def reference(batch: Batch, impl: Any, layer: torch.nn.Module) -> torch.Tensor:
    """(N, HQ * HEAD) float64: what each query must see, as v0.20.2 defines it.

    Decode rows and continuation chunks of <= 128 queries attend to the
    cache only (their own tokens were stored before forward); first chunks
    attend to the raw K/V of the batch; larger continuation chunks to the
    cached context plus the chunk's raw K/V.
    """
    cfg = impl.tq_config
    centroids = plain(layer._tq_centroids)
    reqs = batch.reqs
    num_decodes = 0
    if max(r.q for r in reqs) > 1:
        while reqs[num_decodes].q == 1:
            num_decodes += 1
    else:
        num_decodes = len(reqs)
    q_all = plain(batch.query).cpu().double().reshape(-1, HQ, HEAD)
    out, start = [], 0
    for i, r in enumerate(reqs):
        k_c, v_c = dequant(batch.kv_slots, batch.slots[i], cfg, centroids)
        k, v = k_c.clone(), v_c.clone()
        chunk_raw = i >= num_decodes and (r.cached == 0 or r.q > THRESHOLD)
        if chunk_raw:
            k[r.cached :] = batch.k_raw[i][r.cached :].double()
            v[r.cached :] = batch.v_raw[i][r.cached :].double()
        q = q_all[start : start + r.q]  # (q, HQ, HEAD)
        start += r.q
        kk = k.repeat_interleave(HQ // HK, dim=1)  # (seq, HQ, HEAD)
        vv = v.repeat_interleave(HQ // HK, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * impl.scale
        pos_q = torch.arange(r.q).unsqueeze(1) + r.cached
        mask = torch.arange(r.seq).unsqueeze(0) <= pos_q
        scores = scores.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(out).reshape(-1, HQ * HEAD)


def assert_matches_reference(
    got: torch.Tensor, batch: Batch, impl: Any, layer: torch.nn.Module
) -> None:
    # The reference is exact; the op computes in fp32 and rounds to fp16,
    # its softmax over fp16 scores of the first-chunk path included.
    want = reference(batch, impl, layer)
    got64 = plain(got).cpu().double()
    err = (got64 - want).abs().max().item()
    assert torch.isfinite(got64).all()
    assert err < 2e-2, f"max |out - ref| = {err:.3g}"


# --------------------------------------------------------------------------
# Regression: no host read of the metadata's device tensors in forward()
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, HOST_READ)
@pytest.mark.parametrize("scenario", [*SCENARIOS, "cudagraph_capture"])
def test_forward_reads_no_device_tensor(env, scenario: str) -> None:
    """Every prefill shape goes through forward() without a host read.

    Fails on v0.20.2: ``query_start_loc.tolist()`` in _prefill_attention
    (``max(seq_lens[num_decodes:].tolist())`` first for the mixed batch).
    ``cudagraph_capture`` is the reported crash: the runner's metadata for
    a full-graph capture of a uniform spec-decode batch.
    """
    impl = make_impl(env)
    layer = make_layer(env, impl)
    reqs = CAPTURE_BATCH if scenario == "cudagraph_capture" else SCENARIOS[scenario]
    batch = make_batch(env, impl, layer, reqs, seed=zlib.crc32(scenario.encode()))
    builder = make_builder(env)
    if scenario == "cudagraph_capture":
        meta, _ = capture_metadata(builder, batch, watch=True)
        run_step(impl, layer, batch, meta)  # dummy contents: output unused
    else:
        meta = builder.build(0, watched(batch.cam))
        out = run_step(impl, layer, batch, meta)
        assert_matches_reference(out, batch, impl, layer)


# --------------------------------------------------------------------------
# With flash-attn's code paths (a stand-in kernel on CPU)
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, HOST_READ)
@pytest.mark.cpu_only  # a CPU stand-in for flash-attn
@pytest.mark.parametrize("scenario", ["first_chunk", "mixed", "large_continuation"])
def test_forward_flash_attn_paths_read_no_device_tensor(
    env, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flash-attn branches (fast path, per-request first chunk, large
    continuation) with a PyTorch stand-in for the kernel."""
    monkeypatch.setattr(env.tq, "_HAS_FLASH_ATTN", True)
    monkeypatch.setattr(
        env.tq, "flash_attn_varlen_func", h.ReferenceFlashAttn(), raising=False
    )
    impl = make_impl(env)
    impl.fa_version = None
    layer = make_layer(env, impl)
    batch = make_batch(env, impl, layer, SCENARIOS[scenario], seed=7)
    meta = make_builder(env).build(0, watched(batch.cam))
    out = run_step(impl, layer, batch, meta)
    assert_matches_reference(out, batch, impl, layer)


# --------------------------------------------------------------------------
# CUDA graph capture metadata, replayed with new lengths
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, REPLAY_DIFFERS)
@pytest.mark.bug_signature(AssertionError, HOST_READ)
def test_capture_metadata_replays_context_aware_path(env) -> None:
    """What a full graph captures must serve the batches it is replayed for.

    A graph keeps the host ints of the capture-time metadata; a replay
    changes only the contents of the device buffers. So: run a step on
    the capture metadata (the runner's dummy values), refill its device
    buffers in place with a real batch of the same shape, and run again
    with the capture-time host ints. It must equal an eager step, bit for
    bit, and the reference: the captured branch must take each row's
    cached context from the device seq_lens, not treat the rows as the
    first chunks the dummy values describe.

    Both runs watch the device tensors: re-running forward() stands for a
    replay only if forward() reads none of them on the host (such a read
    is also a crash under capture, v0.20.x's #40807).

    Signatures: ``replay differs from eager`` (v0.21.0+: upstream's
    build_for_cudagraph_capture fills device seq_lens with 1 but leaves the
    host copy at the runner's dummy value q_len, so the first-chunk branch
    is recorded and replays ignore the cache), or a host read (v0.20.x).
    """
    impl = make_impl(env)
    layer = make_layer(env, impl)
    batch = make_batch(env, impl, layer, CAPTURE_BATCH, seed=11)
    builder = make_builder(env)
    captured, bufs = capture_metadata(builder, batch, watch=True)
    run_step(impl, layer, batch, captured)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        plain(getattr(bufs, name)).copy_(plain(getattr(batch.cam, name)))
    replayed = run_step(impl, layer, batch, captured)
    eager = run_step(impl, layer, batch, builder.build(0, batch.cam))
    diff = (replayed.double() - eager.double()).abs().max().item()
    assert torch.equal(replayed, eager), (
        f"replay differs from eager: max |replay - eager| = {diff:.3g}; the "
        "captured branch does not follow the replayed device seq_lens"
    )
    assert_matches_reference(replayed, batch, impl, layer)


# --------------------------------------------------------------------------
# Async spec decode: the CPU knows only an upper bound of seq_lens
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, HOST_UPPER_BOUND)
def test_async_spec_decode_optimistic_host_seq_lens(env) -> None:
    """Under async spec decode the CPU seq_lens assume every draft was
    accepted; the device seq_lens are exact. The decode-kernel branch must
    take its lengths from the device: same output as with exact host
    lengths, and as the reference.

    Signature ``continuation seq_lens follow the host upper bound``
    (v0.21.0+: the small-continuation branch slices its causal lengths out
    of an arange with the host seq_len). v0.20.x reads the device seq_lens
    on the host (the sync of #40807, which test_forward_reads_no_device_tensor
    shows), exact here: this test passes there."""
    impl = make_impl(env)
    layer = make_layer(env, impl)
    # Two rows whose drafts were partly rejected, one exact; q_len 2 and 3.
    reqs = [Req(9, 3), Req(12, 2), Req(6, 2)]
    exact = make_batch(env, impl, layer, reqs, seed=5)
    optimistic = make_batch(env, impl, layer, reqs, seed=5, optimistic={0: 2, 1: 1})
    builder = make_builder(env)
    meta = builder.build(0, optimistic.cam)
    host = getattr(meta, "seq_lens_cpu", None)
    if host is not None:  # the metadata carries the optimistic host lengths
        assert h.host_ints(host)[:2] == [reqs[0].seq + 2, reqs[1].seq + 1]
    out = run_step(impl, layer, optimistic, meta)
    want = run_step(impl, layer, exact, builder.build(0, exact.cam))
    diff = (out.double() - want.double()).abs().max().item()
    assert torch.equal(out, want), (
        "continuation seq_lens follow the host upper bound: with optimistic "
        f"CPU seq_lens the output differs from exact ones by {diff:.3g}"
    )
    assert_matches_reference(out, optimistic, impl, layer)


# --------------------------------------------------------------------------
# Builder: host copies equal the device tensors (property-based)
# --------------------------------------------------------------------------


@st.composite
def batches(draw) -> tuple[list[Req], int]:
    """Decodes first (q 1, or 1 + k spec tokens), then prefill chunks, then
    padding requests (q 0, seq 0) as in a padded CUDA-graph batch."""
    k = draw(st.integers(0, 3))
    decodes = draw(
        st.lists(st.builds(Req, st.integers(1, 300), st.just(1 + k)), max_size=5)
    )
    prefills = draw(
        st.lists(st.builds(Req, st.integers(0, 300), st.integers(2, 200)), max_size=5)
    )
    reqs = decodes + prefills or [Req(3, 1)]
    return reqs, draw(st.integers(0, 2))


def _cam_only(env: SimpleNamespace, reqs: list[Req], pad: int) -> Any:
    qlens = [r.q for r in reqs] + [0] * pad
    seqs = [r.seq for r in reqs] + [0] * pad
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seqs, dtype=torch.int32)
    n = int(qsl[-1])
    return h.common_attn_metadata(
        query_start_loc=qsl.to(DEVICE, copy=True),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(DEVICE, copy=True),
        num_reqs=len(qlens),
        num_actual_tokens=n,
        max_query_len=max(qlens),
        max_seq_len=max(seqs),
        block_table_tensor=torch.zeros(len(qlens), 4, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        _seq_lens_cpu=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens,
    )


def host_copy(meta: Any, name: str) -> list[int]:
    """The metadata's host copy ``name`` (a list with tq/0002, a CPU tensor
    upstream) as ints; it must exist: without it forward() can only read the
    device tensor on the host."""
    values = getattr(meta, name, None)
    assert values is not None, (
        f"the metadata carries no host {name}: forward() reads the device "
        "tensor on the host"
    )
    return h.host_ints(values)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    # One failure (the smallest), not an exception group: a verdict needs one.
    report_multiple_bugs=False,
)
@given(batch=batches())
def test_builder_host_copies_match_device(env, batch) -> None:
    """The builder's host copies equal the device tensors, without reading
    them; at capture, host and device seq_lens agree (the captured branch
    is chosen on the host, the replayed lengths come from the device) and
    give every row context beyond its query (replays serve decodes and
    spec-decode verification only).

    Upstream v0.21.0+ fails the capture half: device seq_lens filled with 1,
    host copy left at the runner's values."""
    reqs, pad = batch
    builder = make_builder(env)
    cam = _cam_only(env, reqs, pad)
    meta = builder.build(0, watched(cam))
    assert host_copy(meta, "query_start_loc_cpu") == plain(cam.query_start_loc).tolist()
    assert host_copy(meta, "seq_lens_cpu") == plain(cam.seq_lens).tolist()

    # Capture: host and device agree, every row has context beyond its query.
    cam = _cam_only(env, reqs, pad)
    meta = builder.build_for_cudagraph_capture(watched(cam))
    host = host_copy(meta, "seq_lens_cpu")
    assert host == plain(meta.seq_lens).tolist(), (
        f"capture metadata: host seq_lens {host} != device "
        f"{plain(meta.seq_lens).tolist()}"
    )
    qsl = host_copy(meta, "query_start_loc_cpu")
    assert qsl == plain(cam.query_start_loc).tolist()
    assert all(s > qsl[i + 1] - qsl[i] for i, s in enumerate(host)), (
        f"capture metadata: rows without context (seq_lens {host}, "
        f"query_start_loc {qsl}) record the first-chunk branch"
    )


def test_builder_without_cpu_seq_lens(env) -> None:
    """Metadata built without the CPU upper bound (the drafter's copy from
    ``CommonAttentionMetadata.unpadded()`` drops it up to v0.29.0): the
    builder takes the exact CPU seq_lens where the tree still has them
    (``_seq_lens_cpu``, up to v0.29.0), and with neither copies seq_lens
    once, in the builder, never in forward().

    Upstream v0.21.0+ fails: it passes only the upper bound on, and
    forward() falls back to ``seq_lens.tolist()``."""
    reqs = SCENARIOS["mixed"]
    want = [r.seq for r in reqs]
    builder = make_builder(env)
    cam = _cam_only(env, reqs, 0)
    if h.cam_has_field("_seq_lens_cpu"):
        no_bound = h.cam_replace(cam, seq_lens_cpu_upper_bound=None)
        assert host_copy(builder.build(0, watched(no_bound)), "seq_lens_cpu") == want
    neither = h.cam_replace(cam, seq_lens_cpu_upper_bound=None, _seq_lens_cpu=None)
    assert host_copy(builder.build(0, neither), "seq_lens_cpu") == want
    with pytest.raises(HostReadError, match="cpu"):
        builder.build(0, watched(neither))


# --------------------------------------------------------------------------
# Equivalence with the unpatched code (needs VLLM_BASE_TREE)
# --------------------------------------------------------------------------


def _load_unpatched(env: SimpleNamespace) -> Any:
    base = os.environ.get("VLLM_BASE_TREE", "")
    if not base:
        pytest.skip("set VLLM_BASE_TREE to a vLLM tree without this patch")
    path = Path(base) / TQ_PATH
    if not path.is_file():
        pytest.fail(f"VLLM_BASE_TREE={base}: no {TQ_PATH}")
    if path.read_bytes() == (env.tree / TQ_PATH).read_bytes():
        pytest.skip("VLLM_TREE is the unpatched tree itself")
    # The unpatched module imports its kernels from VLLM_TREE: the same
    # code only if this patch leaves them alone.
    for dep in (
        "vllm/v1/attention/ops/triton_turboquant_decode.py",
        "vllm/v1/attention/ops/triton_turboquant_store.py",
        "vllm/v1/attention/backend.py",
    ):
        if (Path(base) / dep).read_bytes() != (env.tree / dep).read_bytes():
            pytest.skip(f"{dep} differs between the trees")
    spec = importlib.util.spec_from_file_location("_tq_unpatched", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("scenario", [*SCENARIOS])
def test_outputs_bit_exact_vs_unpatched(env, scenario: str) -> None:
    """Patched and unpatched forward() give identical bits on identical
    inputs and cache: both launch the same kernels with the same integer
    arguments; only where the ints come from changed (host lists, and the
    continuation seq_lens computed on device from seq_lens instead of an
    arange of host ints: equal values)."""
    base_tq = _load_unpatched(env)
    outs = []
    for tq in (env.tq, base_tq):
        impl = make_impl(env, tq)
        layer = make_layer(env, impl)
        batch = make_batch(env, impl, layer, SCENARIOS[scenario], seed=3)
        meta = make_builder(env, tq).build(0, batch.cam)
        outs.append(run_step(impl, layer, batch, meta))
    assert torch.equal(outs[0], outs[1])
