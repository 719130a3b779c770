"""TurboQuant decode with the GQA group as a tile dimension (tq-v0.33, the
grouped split-K decode patch).

v0.33.0's decode kernel runs one program per (request, query head, split):
the ``Hq // Hk`` query heads that share a KV head each load and dequantize
its compressed bytes again. The regression test counts, in Triton's
interpreter, which programs of a decode step load each byte of the KV cache:
one per query head on the base, one per query group patched (a performance
bug cannot be timed here; the reads are its signature).

The other tests hold the new kernel to the old one's numbers and contract:
its outputs against float64 attention over the K/V the cache holds (read
back from the bytes, ``tqbatches.dequant``) no worse than v0.33.0's kernel
(on CPU: than the output's rounding, which v0.33.0's error is there) at
every shape, for every preset; the same bits on the same inputs and
after a CUDA-graph style capture and refill; within the workspace the
builder reserves before the lock; and its split count from host sizes only.
Its error does not grow with the tokens one split walks, with ``tl.dot``
rounding as the tensor cores do (``tqharness.tensor_core_dots``), and the
backend takes it only where it was measured right and faster.

Small shapes: on CPU every Triton kernel runs in the interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tqbatches as tb
import tqharness as h

Req = tb.Req
# Every preset: 4- and 3-bit values, FP8 and 4- and 3-bit keys.
PRESETS = {
    "4bit_nc": "turboquant_4bit_nc",
    "k8v4": "turboquant_k8v4",
    "3bit_nc": "turboquant_3bit_nc",
    "k3v4_nc": "turboquant_k3v4_nc",
}
READS = r"^each KV head's bytes are read by \d+ programs per decode step"
VERIFY_READS = r"^verification rows read each KV head's bytes in \d+ programs"
GROUPED_LAUNCHER = "triton_turboquant_grouped_decode_attention"
LONG_SPLIT = r"^grouped decode error grows with the tokens a split walks"
SINK = r"^grouped decode loses the tokens far below an attention sink"


@pytest.fixture(scope="module", params=list(PRESETS))
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a tiny GQA model (Hq 4, Hk 1, D 64)."""
    shape = tb.Shape(hq=4, hk=1, head=64, preset=PRESETS[request.param])
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"tiny_{request.param}"
    )


# --------------------------------------------------------------------------
# Reads of the KV cache, counted in Triton's interpreter
# --------------------------------------------------------------------------


@contextlib.contextmanager
def cache_reads(cache: torch.Tensor) -> Iterator[list]:
    """Every load from ``cache``'s storage while the context is open, as
    (program, byte addresses): a program is (launch, grid index)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    storage = cache.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    reads: list = []
    launches = [0]
    set_grid_dim, masked_load = builder.set_grid_dim, builder.create_masked_load

    def counting_grid_dim(*dims: int) -> None:
        launches[0] += 1
        set_grid_dim(*dims)

    def counting_load(ptrs, mask, *args):
        addrs = np.asarray(ptrs.data).astype(np.int64)
        keep = np.broadcast_to(np.asarray(mask.data), addrs.shape)
        keep = keep & (addrs >= lo) & (addrs < hi)
        if keep.any():
            size = ptrs.get_element_ty().primitive_bitwidth // 8
            first = addrs[keep]
            every = (first[:, None] + np.arange(size)[None, :]).ravel()
            reads.append(((launches[0], *builder.grid_idx), every))
        return masked_load(ptrs, mask, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "set_grid_dim", counting_grid_dim)
        mp.setattr(builder, "create_masked_load", counting_load)
        yield reads


@contextlib.contextmanager
def launch_grids() -> Iterator[list]:
    """The grid of every Triton launch while the context is open (in the
    interpreter; nothing is recorded on a GPU)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    grids: list = []
    set_grid_dim = builder.set_grid_dim

    def recording(*dims: int) -> None:
        grids.append(dims)
        set_grid_dim(*dims)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "set_grid_dim", recording)
        yield grids


def attended_bytes(batch: tb.Batch, cfg: Any) -> np.ndarray:
    """Addresses of the slot record bytes of every token the batch attends
    to (in the pages of either layout, ``h.record_offsets``)."""
    slots = batch.kv_slots
    base = slots.untyped_storage().data_ptr() + slots.storage_offset()
    block = slots.shape[1]
    offs = h.record_offsets(slots, cfg, batch.soa)[..., : cfg.slot_size]
    out = []
    for req_slots in batch.slots:
        pages = base + (req_slots // block) * slots.stride(0)
        out.append((pages[:, None, None] + offs[req_slots % block]).ravel())
    return torch.cat(out).numpy()


@pytest.mark.cpu_only  # counts loads in Triton's interpreter
@pytest.mark.bug_signature(AssertionError, READS)
def test_kv_bytes_read_once_per_query_group(env: tb.Backend) -> None:
    """A decode step of three requests (Hq 4 on Hk 1): every byte of the
    slots they attend to is loaded by one program, once."""
    impl, layer, batch = tb.decode_batch(env, [200, 77, 16], seed=28)
    meta = env.builder().build(0, batch.cam)
    with cache_reads(batch.kv_cache) as reads:
        tb.forward(impl, layer, batch, meta)
    per_byte = readers_per_byte(reads)
    addr = np.concatenate([a for _, a in reads])
    group = env.shape.hq // env.shape.hk
    if per_byte.max() > 1:
        raise AssertionError(
            f"each KV head's bytes are read by {per_byte.max()} programs per "
            f"decode step, one per query head (Hq {env.shape.hq}, Hk "
            f"{env.shape.hk}: group of {group}), not once per query group"
        )
    _, loads = np.unique(addr, return_counts=True)
    assert loads.max() == 1, f"a cache byte is loaded {loads.max()} times"
    want = attended_bytes(batch, h.tq_config(env.shape.preset, 64))
    assert np.array_equal(np.unique(addr), np.unique(want)), (
        "the step reads other bytes than the attended tokens' slots"
    )


def readers_per_byte(reads: list) -> np.ndarray:
    """For each cache byte loaded, the number of programs that load it."""
    programs = {p: i for i, p in enumerate(dict.fromkeys(p for p, _ in reads))}
    pid = np.concatenate([np.full(a.size, programs[p]) for p, a in reads])
    addr = np.concatenate([a for _, a in reads])
    readers = np.unique(np.stack([addr, pid]), axis=1)[0]
    return np.unique(readers, return_counts=True)[1]


@pytest.mark.cpu_only  # counts loads in Triton's interpreter
@pytest.mark.bug_signature(AssertionError, VERIFY_READS)
@pytest.mark.parametrize("env", ["4bit_nc", "k8v4"], indirect=True)  # MSE, FP8 keys
def test_verification_rows_read_kv_once_per_query_group(
    env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding's verification rows (1 + k tokens after a
    context; the small continuation takes them as decodes, one row a token):
    every cache byte is loaded by one program a row that attends to it, not
    one a query head. v0.33.0's kernel at 4 splits, not 32: the count is
    the same, the interpreter's time an eighth."""
    tb.small_continuation_splits(env.tq, 4, monkeypatch.setattr)
    impl = env.impl()
    layer = env.layer(impl)
    reqs = [tb.Req(120, 4), tb.Req(37, 3)]
    batch = tb.make_batch(env, impl, layer, reqs, seed=53410, store_context=False)
    n = batch.num_tokens
    impl.do_kv_cache_update(
        layer, batch.key, batch.value, batch.kv_cache, batch.slot_mapping[:n]
    )
    meta = env.builder().build(0, batch.cam)
    with cache_reads(batch.kv_cache) as reads:
        out = tb.forward(impl, layer, batch, meta)
    tb.check_rows(out[:n], batch, impl, layer)
    most, rows = readers_per_byte(reads).max(), max(r.q for r in reqs)
    if most > rows:
        raise AssertionError(
            f"verification rows read each KV head's bytes in {most} programs "
            f"for {rows} verified tokens: one a query head (group of "
            f"{env.shape.hq // env.shape.hk}), not one a query group"
        )


# --------------------------------------------------------------------------
# The new kernel: numbers and contract
# --------------------------------------------------------------------------


def grouped_module() -> Any:
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    return gd


# (Hq, Hk, D, block, cached contexts, splits): GQA 4, 2, 3 (padded to 4) and
# 1; contexts of one token, across blocks, not a multiple of the kernel's
# tile; one split, several, more than the tiles.
SHAPES = {
    "g4-d64": (4, 1, 64, 16, [0, 36, 99, 200], 3),
    "g4-d64-one-split": (4, 1, 64, 16, [130], 1),
    "g2-d128-b32": (4, 2, 128, 32, [64, 17], 5),
    "g3-d64": (6, 2, 64, 16, [49, 128], 4),
    "g1-d64-many-splits": (2, 2, 64, 16, [40], 64),
}


@pytest.fixture(scope="module")
def shape_env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[tb.Backend, Any]]:
    preset, key = request.param
    hq, hk, d, block, cached, splits = SHAPES[key]
    shape = tb.Shape(hq=hq, hk=hk, head=d, block=block, preset=PRESETS[preset])
    for env in tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"tiny_{preset}_{key}"
    ):
        yield env, (cached, splits)


@pytest.mark.parametrize(
    "shape_env",
    [(p, s) for p in PRESETS for s in SHAPES],
    ids=[f"{p}-{s}" for p in PRESETS for s in SHAPES],
    indirect=True,
)
def test_matches_reference_no_worse_than_v0_33(shape_env) -> None:
    """Both kernels against float64 attention over what the cache holds:
    the grouped kernel's largest error is at most v0.33.0's, or within the
    output's own rounding (half an fp16 ulp at the largest |output|). A
    padding row of no tokens gives zeros; the same inputs give the same
    bits. In Triton's interpreter (numpy fp32, no tensor cores) v0.33.0's
    error at these shapes is the output's rounding (2026-11-27: at most
    1.002 half ulps in each of the 20 cases), so there the bound is the
    rounding and v0.33.0's kernel, three quarters of the test's time on
    CPU, runs on a GPU only. Then bf16 queries and outputs against the
    reference of the bf16 query, within a bf16 ulp (the interpreter rounds
    fp32 to bf16 toward zero) and 2**-11 of the largest |output|: with bf16
    queries the registers stage 1 rounds MSE keys' centroids to fp16 alone,
    each score to about 2**-12 of itself (3-bit keys there: 1.014 ulps)."""
    env, (cached, splits) = shape_env
    impl, layer, batch = tb.decode_batch(env, cached, seed=sum(cached) + splits)
    old_splits = 4 if torch.cuda.is_available() else None
    old, new = tb.decode_kernels(impl, layer, batch, splits, 1, old_splits)
    want = torch.cat(tb.reference(batch, impl, layer))
    got_new = new[:-1].cpu().double().reshape(want.shape)
    err_new = (got_new - want).abs().max().item()
    bound = rounding = tb.half_ulp(new.dtype, want)
    if old is not None:
        got_old = old[:-1].cpu().double().reshape(want.shape)
        bound = max((got_old - want).abs().max().item(), rounding)
    assert err_new <= bound * 1.01, (
        f"grouped decode error {err_new:.3g} > {bound:.3g}, v0.33.0's or the "
        f"output's rounding ({rounding:.3g})"
    )
    assert torch.equal(new[-1], torch.zeros_like(new[-1])), "padding row not zero"
    _, again = tb.decode_kernels(impl, layer, batch, splits, pad=1, old_splits=None)
    assert torch.equal(again[:-1], new[:-1]), "same inputs, other bits"
    bf16 = dataclasses.replace(batch, query=batch.query.bfloat16())
    _, new = tb.decode_kernels(impl, layer, bf16, splits, old_splits=None)
    bf16.query = bf16.query.half()  # exact: the reference takes fp16
    want = torch.cat(tb.reference(bf16, impl, layer))
    err = (new.cpu().double().reshape(want.shape) - want).abs().max().item()
    bound = 2 * tb.half_ulp(new.dtype, want) + 2**-11 * want.abs().max().item()
    assert err <= bound, f"grouped decode error {err:.3g} > {bound:.3g} at bf16"


# The fp32 partial output of one split of 8K tokens against float64: the
# fp32 sums' rounding gives 1.0-1.8e-6 here; an MMA chain that accumulates
# the split's running sum, truncating it every 16 tokens, 1.5-1.7e-5.
LONG_SPLIT_BOUND = 5e-6


@pytest.mark.cpu_only  # Triton's interpreter, with the tensor cores' rounding
@pytest.mark.bug_signature(AssertionError, LONG_SPLIT)
@pytest.mark.parametrize("preset", ["4bit_nc", "3bit_nc"])
def test_long_split_error_flat(vllm_tree: Path, tmp_path: Path, preset: str) -> None:
    """The error does not grow with the tokens one program walks: 8K tokens
    of one request in one split, with the interpreter's dots rounding as
    the tensor cores do (``tqharness.tensor_core_dots``), the split's fp32
    partial output (stage 1's, before the output's rounding) against
    float64. An MMA accumulating into the split's running sum truncates it
    toward zero every 16 tokens (on an H100 at 128 x 128K, 3 splits: 20x
    v0.33.0's error before the codes were centred). 3bit_nc takes the first
    stage 1 everywhere, 4bit_nc (fp16, one request) the registers one where
    the tree has it."""
    tokens = 8192
    shape = tb.Shape(
        hq=4, hk=1, head=64, max_model_len=tokens + 16, preset=PRESETS[preset]
    )
    with pytest.MonkeyPatch.context() as mp:
        env = tb.open_backend(vllm_tree, tmp_path, shape, mp.setattr)
        h.tensor_core_dots(mp.setattr)
        try:
            impl, layer, batch = tb.decode_batch(env, [tokens - 1], seed=3)
            mid = torch.zeros(4 * 65, device=batch.query.device)  # Hq x (D + 1)
            tb.decode_kernels(impl, layer, batch, 1, old_splits=None, mid_o_buf=mid)
        finally:
            tb.close_backend()
    want = torch.cat(tb.reference(batch, impl, layer)).reshape(-1)
    got = mid[: want.numel()].cpu().double()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= LONG_SPLIT_BOUND, (
        f"grouped decode error grows with the tokens a split walks: {err:.3g} "
        f"in 1 split of {tokens} tokens (the fp32 partial output, relative L2; "
        f"over {LONG_SPLIT_BOUND:g})"
    )


def scale_values(batch: tb.Batch, cfg: Any, row: int, factor: float) -> None:
    """Request ``row``'s stored values times ``factor``: their fp16 scales
    and zero points (the two fields after the value codes) in the cache."""
    codes = math.ceil(cfg.head_dim * cfg.effective_value_quant_bits / 8)
    at = cfg.key_packed_size + codes
    slots = batch.slots[row]
    records = h.read_records(batch.kv_slots, slots, cfg, batch.soa)
    fields = records[..., at : at + 4].contiguous().view(torch.float16) * factor
    records[..., at : at + 4] = fields.view(torch.uint8)
    h.write_records(batch.kv_slots, slots, records, cfg, batch.soa)


def sink_query(batch: tb.Batch, impl: Any, layer: Any, nats: float) -> None:
    """Every query head of the one request aimed at its first token: that
    token scores ``nats`` above the mean of the others (spread by the keys'
    angles to it, about nats / sqrt(D) nats)."""
    centroids = tb.plain(layer._tq_centroids)
    cfg = impl.tq_config
    k, _ = tb.dequant(batch.kv_slots, batch.slots[0], cfg, centroids, batch.soa)
    sink = k[0, 0]
    q = (nats / impl.scale) * sink / sink.dot(sink)
    q = q.repeat(impl.num_heads).reshape(batch.query.shape)
    batch.query = q.to(batch.query.dtype).to(batch.query.device)


# One preset for each value path of both stage-1 kernels (fp16 queries, one
# request): 3- and 4-bit values in 0009's, FP8 and 4-bit keys (its
# centroids' low parts) in the registers one where the tree has it.
SINK_PRESETS = ["3bit_nc", "k3v4_nc", "k8v4", "4bit_nc"]


@pytest.mark.cpu_only  # Triton's interpreter, with the tensor cores' rounding
@pytest.mark.bug_signature(AssertionError, SINK)
@pytest.mark.parametrize("preset", SINK_PRESETS)
def test_attention_sink_keeps_far_tokens(
    vllm_tree: Path, tmp_path: Path, preset: str
) -> None:
    """Attention as trained models have it: one token (an attention sink)
    15 nats above the other 4K tokens of its split, values of small scale
    (std about 0.08). A token that far below the split's maximum has p x
    scale near fp16's subnormals: split into fp16 high and low parts as is,
    its code x scale term vanishes while its zero-point term stays, and the
    output loses a one-signed part (on an H200, 2-21x v0.33.0's error). The
    error here: at most 1.25x the output's own rounding (v0.33.0's error on
    CPU), and not one-sided (|mean / RMS| <= 0.3)."""
    tokens = 4096
    shape = tb.Shape(
        hq=4, hk=1, head=64, max_model_len=tokens + 16, preset=PRESETS[preset]
    )
    with pytest.MonkeyPatch.context() as mp:
        env = tb.open_backend(vllm_tree, tmp_path, shape, mp.setattr)
        h.tensor_core_dots(mp.setattr)
        try:
            impl, layer, batch = tb.decode_batch(env, [tokens - 1], seed=3)
            scale_values(batch, impl.tq_config, 0, 1 / 16)
            sink_query(batch, impl, layer, 15.0)
            out = tb.decode_kernels(impl, layer, batch, 1, old_splits=None)[1]
        finally:
            tb.close_backend()
    want = torch.cat(tb.reference(batch, impl, layer))
    err = out.cpu().double().reshape(want.shape) - want
    rounding = want.half().double() - want
    rel, bound = (e.norm().item() / want.norm().item() for e in (err, rounding))
    bias = (err.mean() / err.pow(2).mean().sqrt()).item()
    assert rel <= 1.25 * bound and abs(bias) <= 0.3, (
        f"grouped decode loses the tokens far below an attention sink: "
        f"error {rel:.3g} (relative L2; the output's rounding {bound:.3g}), "
        f"mean / RMS of the error {bias:+.2f}"
    )


def test_graph_replay_matches_eager(env: tb.Backend) -> None:
    """A decode step through the impl with metadata captured on the runner's
    dummy values (device tensors unreadable on the host), then refilled, as
    a full CUDA graph replays it: the same launches (grids: the split count)
    as the eager step, bit-identical to it, right."""
    impl, layer, batch = tb.decode_batch(env, [45, 3, 130], seed=7)
    builder = env.builder()
    captured, bufs = tb.capture_metadata(builder, batch, watch=True)
    tb.forward(impl, layer, batch, captured)  # the capture: dummy contents
    tb.refill(bufs, batch)
    with launch_grids() as replay_grids:
        replayed = tb.forward(impl, layer, batch, captured)
    with launch_grids() as eager_grids:
        eager = tb.forward(impl, layer, batch, builder.build(0, batch.cam))
    assert replay_grids == eager_grids, (
        f"replay launches {replay_grids}, eager {eager_grids}"
    )
    assert torch.equal(replayed, eager), "replay differs from eager"
    tb.assert_matches_reference(eager, batch, impl, layer)


def decode_requests(calls: list, head: int) -> list[int]:
    """Bytes of each recorded workspace request for decode buffers: its
    first buffer the (B, Hq, splits, D + 1) fp32 partials."""
    return [
        sum(math.prod(shape) * dtype.itemsize for shape, dtype in req)
        for req in calls
        if len(req[0][0]) == 4 and req[0][0][-1] == head + 1
    ]


def layer_registers_decode_buffers() -> bool:
    """v0.20.x: the Attention layer registers TurboQuant's decode buffers
    (later releases' builder reserves them in the workspace)."""
    import inspect

    from vllm.model_executor.layers.attention import attention

    return '"_tq_mid_o_buf"' in inspect.getsource(attention)


def test_decode_within_reserved_buffers(env: tb.Backend) -> None:
    """Decode steps of one request (the most splits) and of max_num_seqs
    requests stay within the decode buffers reserved before the workspace
    lock (v0.21+: by the builder, in the workspace; v0.20.x: registered by
    the Attention layer); a batch of one spends more splits than the
    release's fixed count."""
    if layer_registers_decode_buffers():
        within_layer_buffers(env)
    else:
        within_reserved_workspace(env)


def within_reserved_workspace(env: tb.Backend) -> None:
    """Decode asks the workspace for no more than the builder reserves for
    decode (and, locked after the reservation as after graph capture, gets
    it)."""
    from vllm.v1.worker import workspace

    calls: list = []
    get = workspace.WorkspaceManager.get_simultaneous

    def recording(self, *shapes_and_dtypes):
        calls.append(shapes_and_dtypes)
        return get(self, *shapes_and_dtypes)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workspace.WorkspaceManager, "get_simultaneous", recording)
        # As the runner: a fresh manager, the builder's reservation, the lock.
        workspace.reset_workspace_manager()
        workspace.init_workspace_manager(tb.DEVICE)
        env.builder()
        (reserved,) = decode_requests(calls, env.shape.head)
        manager = workspace.current_workspace_manager()
        manager.lock()
        try:
            for cached in ([70], [5, 33, 16, 1, 64, 2, 17, 40]):
                impl, layer, batch = tb.decode_batch(env, cached, seed=len(cached))
                meta = env.builder().build(0, batch.cam)
                out = tb.forward(impl, layer, batch, meta)
                tb.assert_matches_reference(out, batch, impl, layer)
        finally:
            manager.unlock()
    asked = decode_requests(calls, env.shape.head)[1:]
    assert asked and max(asked) <= reserved, (
        f"decode asks the workspace for {asked} bytes, {reserved} reserved"
    )
    one = grouped_module().grouped_decode_num_splits(
        1, env.shape.hk, impl._max_num_reqs * impl.max_num_kv_splits, tb.DEVICE
    )
    assert one > impl.max_num_kv_splits


def within_layer_buffers(env: tb.Backend) -> None:
    """Decode puts its partials in the (max_num_seqs, Hq, S, D + 1) buffer
    the Attention layer registers before the memory profiler runs (no new
    allocation)."""
    gd = grouped_module()
    used: list = []
    split = gd._split_mid_buffer

    def recording(buf, *args):
        mid_o, mid_lse = split(buf, *args)
        used.append(mid_o.untyped_storage().data_ptr())
        return mid_o, mid_lse

    s = env.shape
    for cached in ([70], [5, 33, 16, 1, 64, 2, 17, 40]):
        impl, layer, batch = tb.decode_batch(env, cached, seed=len(cached))
        rows, splits = impl._max_num_reqs, impl.max_num_kv_splits
        mid = torch.empty(rows, s.hq, splits, s.head + 1, device=tb.DEVICE)
        layer.register_buffer("_tq_mid_o_buf", mid, persistent=False)
        meta = env.builder().build(0, batch.cam)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gd, "_split_mid_buffer", recording)
            out = tb.forward(impl, layer, batch, meta)
        tb.assert_matches_reference(out, batch, impl, layer)
        assert used and used[-1] == mid.untyped_storage().data_ptr(), (
            f"decode of {len(cached)} requests allocated its partials"
        )
    one = gd.grouped_decode_num_splits(1, s.hk, rows * splits, tb.DEVICE)
    assert one > splits


def test_num_splits_from_host_sizes() -> None:
    """Splits fill the GPU at batch 1, shrink as the batch grows, stay in
    [1, max_splits]; the same sizes give the same count."""
    gd = grouped_module()
    dev = tb.DEVICE
    sms = gd._num_sms(dev)
    counts = [gd.grouped_decode_num_splits(b, 4, 1024, dev) for b in (1, 8, 32, 128)]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1
    assert 4 * counts[0] >= gd._PROGRAMS_PER_SM * sms
    assert gd.grouped_decode_num_splits(1, 4, 3, dev) == 3
    assert gd.grouped_decode_num_splits(1 << 20, 4, 64, dev) == 1
    assert counts == [
        gd.grouped_decode_num_splits(b, 4, 1024, dev) for b in (1, 8, 32, 128)
    ]


# (head size, query heads a KV head, preset): where the backend takes the
# grouped decode, and where v0.33.0's kernel stays, as measured on an H100 (D
# 512 with group 64 needs 262,144 B of shared memory; group 64 at D 64 faults;
# group 1 and D 512 run slower than v0.33.0's kernel).
GROUPED = [(64, 4, "4bit_nc"), (128, 2, "k8v4"), (256, 16, "3bit_nc")]
NOT_GROUPED = [
    (512, 64, "4bit_nc"),
    (512, 4, "3bit_nc"),
    (64, 64, "4bit_nc"),
    (256, 1, "k8v4"),
    (96, 4, "k8v4"),
]


def takes_grouped(head: int, group: int, preset: str) -> bool:
    cfg = h.tq_config(PRESETS[preset], head)
    bits = (cfg.effective_value_quant_bits, cfg.key_fp8, cfg.key_mse_bits)
    return grouped_module().use_grouped_decode(head, group, *bits)


# What vLLM's platforms answer: CUDA, ROCm (CUDA-alike), XPU, and the CPU.
PLATFORMS = {
    "cuda": {"is_cuda": True, "is_cuda_alike": True},
    "rocm": {"is_rocm": True, "is_cuda_alike": True},
    "xpu": {"is_xpu": True},
    "cpu": {"is_cpu": True},
}


def answer(value: bool) -> Any:
    """A platform check that answers ``value``."""
    return lambda: value


def test_grouped_decode_only_where_measured(vllm_tree: Path) -> None:
    """The grouped decode is taken only at the shapes it was measured right
    and faster at, and only on CUDA: vLLM's ROCm and XPU platforms route
    turboquant_* to this backend too, and it has not run there."""
    from vllm.platforms import current_platform

    gd = grouped_module()
    measured = getattr(gd, "_measured_platform", None)
    for name, answers in PLATFORMS.items():
        with pytest.MonkeyPatch.context() as mp:
            if measured is not None:  # the real one, not the CPU stand-in's
                mp.setattr(gd, "_measured_platform", h.real(measured))
            for check in ("is_cuda", "is_rocm", "is_xpu", "is_cpu", "is_cuda_alike"):
                mp.setattr(current_platform, check, answer(answers.get(check, False)))
            taken = [takes_grouped(*s) for s in GROUPED]
            assert taken == [name == "cuda"] * len(GROUPED), f"grouped on {name}"
            if name == "cuda":
                assert not any(takes_grouped(*s) for s in NOT_GROUPED)


@pytest.mark.parametrize("group, preset", [(64, "4bit_nc"), (4, "3bit_nc")])
def test_d512_decodes_with_v0_33_kernel(
    vllm_tree: Path, tmp_path: Path, group: int, preset: str
) -> None:
    """Head size 512: ``forward`` launches v0.33.0's decode, not the grouped
    one. With 64 query heads a KV head the grouped kernel needs more shared
    memory than an H100 has; 3bit_nc needs 102,400 B at this head size,
    more than sm86/sm89/sm120 parts give (101,376 B)."""
    shape = tb.Shape(hq=group, hk=1, head=512, preset=PRESETS[preset])
    tq = h.tq_module()
    calls: list[str] = []

    def launcher(name: str) -> Any:
        def record(query: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            calls.append(name)
            return torch.zeros_like(query)

        return record

    with pytest.MonkeyPatch.context() as mp:
        env = tb.open_backend(vllm_tree, tmp_path, shape, mp.setattr)
        for name in ("triton_turboquant_decode_attention", GROUPED_LAUNCHER):
            if hasattr(tq, name):
                mp.setattr(tq, name, launcher(name))
        try:
            impl, layer, batch = tb.decode_batch(env, [20, 3], seed=7)
            tb.forward(impl, layer, batch, env.builder().build(0, batch.cam))
        finally:
            tb.close_backend()
    assert calls == ["triton_turboquant_decode_attention"], calls


def test_other_head_sizes_keep_v0_33_kernel(vllm_tree: Path, tmp_path: Path) -> None:
    """A head size that is not a power of two (96, FP8 keys: no rotation): a
    decode step through ``forward`` gives the bits of v0.33.0's kernel (its
    32 splits), not the grouped decode's."""
    shape = tb.Shape(hq=4, hk=1, head=96, preset=PRESETS["k8v4"])
    with pytest.MonkeyPatch.context() as mp:
        env = tb.open_backend(vllm_tree, tmp_path, shape, mp.setattr)
        try:
            impl, layer, batch = tb.decode_batch(env, [40, 3], seed=5)
            meta = env.builder().build(0, batch.cam)
            out = tb.forward(impl, layer, batch, meta)
            splits = impl.max_num_kv_splits
            old = tb.decode_kernels(
                impl, layer, batch, 1, old_splits=splits, grouped=False
            )[0]
        finally:
            tb.close_backend()
    assert torch.equal(out.view_as(old), old), "not v0.33.0's decode kernel"
