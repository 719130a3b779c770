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
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import tqbatches as tb
import tqharness as h
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DEVICE = tb.DEVICE
TQ_PATH = Path("vllm/v1/attention/backends/turboquant_attn.py")
SHAPE = tb.Shape()
HQ, HK, HEAD = SHAPE.hq, SHAPE.hk, SHAPE.head
THRESHOLD = tb.THRESHOLD

# How each bug shows (see the tests' docstrings).
HOST_READ = r"^host read \S+ of a device tensor of the attention metadata"
REPLAY_DIFFERS = r"^replay differs from eager"
HOST_UPPER_BOUND = r"^continuation seq_lens follow the host upper bound"

HostReadError = tb.HostReadError
Req = tb.Req
plain, watched = tb.plain, tb.watched
capture_metadata = tb.capture_metadata
assert_matches_reference = tb.assert_matches_reference


@pytest.fixture(scope="module")
def env(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tb.Backend]:
    with pytest.MonkeyPatch.context() as mp:
        model_dir = tmp_path_factory.mktemp("tiny_qwen3")
        yield tb.open_backend(vllm_tree, model_dir, SHAPE, mp.setattr)
        tb.close_backend()


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
    impl = env.impl()
    layer = env.layer(impl)
    reqs = CAPTURE_BATCH if scenario == "cudagraph_capture" else SCENARIOS[scenario]
    batch = tb.make_batch(env, impl, layer, reqs, seed=zlib.crc32(scenario.encode()))
    builder = env.builder()
    if scenario == "cudagraph_capture":
        meta, _ = capture_metadata(builder, batch, watch=True)
        tb.run_step(impl, layer, batch, meta)  # dummy contents: output unused
    else:
        meta = builder.build(0, watched(batch.cam))
        out = tb.run_step(impl, layer, batch, meta)
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
    impl = env.impl()
    impl.fa_version = None
    layer = env.layer(impl)
    batch = tb.make_batch(env, impl, layer, SCENARIOS[scenario], seed=7)
    meta = env.builder().build(0, watched(batch.cam))
    out = tb.run_step(impl, layer, batch, meta)
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
    impl = env.impl()
    layer = env.layer(impl)
    batch = tb.make_batch(env, impl, layer, CAPTURE_BATCH, seed=11)
    builder = env.builder()
    captured, bufs = capture_metadata(builder, batch, watch=True)
    tb.run_step(impl, layer, batch, captured)
    tb.refill(bufs, batch)
    replayed = tb.run_step(impl, layer, batch, captured)
    eager = tb.run_step(impl, layer, batch, builder.build(0, batch.cam))
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
    impl = env.impl()
    layer = env.layer(impl)
    # Two rows whose drafts were partly rejected, one exact; q_len 2 and 3.
    reqs = [Req(9, 3), Req(12, 2), Req(6, 2)]
    exact = tb.make_batch(env, impl, layer, reqs, seed=5)
    optimistic = tb.make_batch(env, impl, layer, reqs, seed=5, optimistic={0: 2, 1: 1})
    builder = env.builder()
    meta = builder.build(0, optimistic.cam)
    host = getattr(meta, "seq_lens_cpu", None)
    if host is not None:  # the metadata carries the optimistic host lengths
        assert h.host_ints(host)[:2] == [reqs[0].seq + 2, reqs[1].seq + 1]
    out = tb.run_step(impl, layer, optimistic, meta)
    want = tb.run_step(impl, layer, exact, builder.build(0, exact.cam))
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


def _cam_only(env: tb.Backend, reqs: list[Req], pad: int) -> Any:
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
    builder = env.builder()
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
    builder = env.builder()
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


def _load_unpatched(env: tb.Backend) -> Any:
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
        impl = env.impl(tq)
        layer = env.layer(impl)
        batch = tb.make_batch(env, impl, layer, SCENARIOS[scenario], seed=3)
        meta = env.builder(tq).build(0, batch.cam)
        outs.append(tb.run_step(impl, layer, batch, meta))
    assert torch.equal(outs[0], outs[1])
