"""TurboQuant decode against the memory-bandwidth floor (issue 28):
v0.33.0's decode kernel, the grouped split-K kernel of the tq-v0.33 patch
and bf16 FlashAttention-2 decode side by side in one process, on one tree
(the patched tq-v0.33 tree: it holds both TurboQuant kernels).

Shapes: Qwen3.5-9B attention (Hq 16, Hk 4, D 256, bf16), block 16, presets
turboquant_4bit_nc, turboquant_k8v4 and turboquant_3bit_nc (--presets);
decode steps of B in {1, 8, 32, 128} requests, each with L in {4K, 32K,
128K} tokens of context (a cell, or its bf16 stand-in, is skipped when it
does not fit the GPU's memory).

Each cell, CUDA-graph replayed, L2 flushed before every replay, median of 25:

  up     v0.33.0's launcher (triton_turboquant_decode_attention) with the
         buffers v0.33.0's decode path passes (its 32 splits)
  new    the grouped launcher, the patch's defaults and split count
  fwd    the patched impl.forward of the decode step (metadata from the
         tree's builder, workspace locked after its reservation): query
         rotation, grouped kernel, output copy
  best   the grouped launcher at the sweep's best configuration (--sweep)
  fa2    bf16 FlashAttention-2 decode over the same lengths: PyTorch's
         aten._flash_attention_forward, dense batch (``fa2v``: varlen),
         standing in for vllm_flash_attn
  floor  compressed K/V bytes (B x L x Hk x slot) / copy bandwidth, measured
         in the same run (``fa2 floor``: the bf16 bytes)
  peer   (--peer DIR, turboquant_4bit_nc only) vllm#53060's CUDA decode
         (tqpeer.py: its sources staged in DIR by peer_stage.sh, built here)
         on the same cache bytes in its page-local layout: its own dispatch
         (``peer``) and its tensor-core path forced (``peer_mma``)
  prev   (--prev FILE) another grouped decode module (the kernel a patch
         replaced, e.g. 0009's), at its own split count
  planeKwWsS, soaKwWsS (--plane FILE, --plane-configs K:W:S[:FLAGS],...)
         a stage 1 on the page-local plane layout or (FLAG ``s``)
         v0.33.0's turboquant_soa layout (tq_plane_decode.py, issue 54) on
         the same cache bytes in that layout, K tokens a step, W warps, its
         loop pipelined over S stages; FLAG ``c``: 4-bit keys' norms
         corrected by the store (...c: norm / ||c||, as turboquant_soa's
         store holds them, no correction in the decode); its error
         ``err_X_own`` against the K/V its own bytes decode to

--errors: each kernel's relative L2 error on requests 0 and B - 1 of every
cell against float64 attention over the K/V the cache bytes decode to
(tq_decode_accuracy.Shape's reference), computed before the timing.

Before timing, per preset, a decode step is checked on the device
(``check``): both kernels against float64 attention over the K/V the cache
holds (tqbatches.reference), and the forward path captured on the runner's
dummy metadata, refilled and replayed, against an eager step, bit for bit.

--sweep: the grouped kernel's BLOCK_KV x num_warps x programs per SM on
four cells; per preset the best by the geometric mean of its times there.

    python ci/gpu/tq_decode_bench.py --tree T --out DIR [--sweep] [--small] \
        [--peer .peer --errors]

Writes DIR/tq_decode_bench.json and DIR/tq_decode_table.md (printed last).
--small: CPU shapes in Triton's interpreter (no graphs), a sanity run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import tqlib
import tqpeer
from tqlib import h

HQ, HK, D, BLOCK = 16, 4, 256, 16
DTYPE = torch.bfloat16
PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc")
BATCHES = (1, 8, 32, 128)
LENS = (4096, 32768, 131072)
REPS = 25
CHECK_CACHED = [4095, 1000, 37, 2500]
SWEEP_CELLS = ((1, 131072), (8, 32768), (32, 32768), (32, 131072))
# (BLOCK_KV, num_warps, num_stages): tl.dot tiles of at least 16 tokens;
# then programs per SM, a host choice.
SWEEP_KERNELS = (
    (16, 4, 1), (32, 4, 1), (32, 4, 2), (64, 4, 1),
    (64, 4, 2), (32, 8, 2), (64, 8, 2), (16, 2, 2),
)  # fmt: skip
SWEEP_PPSM = (2, 4, 8)
FLUSH_BYTES = 256 << 20  # > H100's 50 MB L2
VERIFY = 0  # tokens each request verifies (speculative decoding), 0: none
ERRORS = False  # --errors: every kernel's error against float64, every cell


def parse_args() -> argparse.Namespace:
    global HQ, HK, D, BATCHES, LENS, REPS, CHECK_CACHED, SWEEP_CELLS
    global SWEEP_KERNELS, SWEEP_PPSM, FLUSH_BYTES, PRESETS, VERIFY, ERRORS
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True, help="directory for the results")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--deadline", type=float, default=0, help="seconds (420)")
    ap.add_argument("--small", action="store_true", help="CPU sanity shapes")
    ap.add_argument("--cells", help="BxL,... instead of all (e.g. 32x32768)")
    ap.add_argument("--presets", help="comma list, e.g. 4bit_nc,k3v4_nc")
    ap.add_argument("--verify", type=int, default=0, help="also time verification")
    ap.add_argument("--peer", help="vllm#53060's staged sources (peer_stage.sh)")
    ap.add_argument("--errors", action="store_true", help="errors vs float64")
    ap.add_argument("--prev", help="a grouped decode module file, timed as 'prev'")
    ap.add_argument("--plane", help="tq_plane_decode.py: the plane layout's decode")
    ap.add_argument("--plane-configs", default="16:1:1", help="BLOCK_KV:warps:stages")
    args = ap.parse_args()
    VERIFY, ERRORS = args.verify, args.errors
    if args.small:
        HQ, HK, D = 4, 1, 64
        BATCHES, LENS, REPS, CHECK_CACHED = (1, 2), (48, 160), 2, [40, 3, 130]
        SWEEP_CELLS, SWEEP_KERNELS, SWEEP_PPSM = ((2, 160),), ((16, 4, 1),), (4,)
        FLUSH_BYTES = 1 << 20
    if args.presets:
        PRESETS = tuple(f"turboquant_{p}" for p in args.presets.split(","))
    args.cells = [parse_cell(c) for c in args.cells.split(",")] if args.cells else None
    args.deadline = args.deadline or (1800 if args.small else 420)
    return args


def parse_cell(text: str) -> tuple[int, int]:
    """A cell "BxL" (requests x context tokens) as (B, L)."""
    batch, length = (int(x) for x in text.split("x"))
    return batch, length


# --------------------------------------------------------------------------
# Timing: graph replays with L2 flushed
# --------------------------------------------------------------------------


def graph_time(fn, flush: torch.Tensor, reps: int) -> dict:
    """Median over ``reps`` replays of ``fn`` captured in a CUDA graph, the
    L2 flushed (``flush`` rewritten) before each; eager calls on CPU."""
    fn()
    tqlib.sync()
    times = []
    if not tqlib.HAS_CUDA:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


@contextlib.contextmanager
def kernel_config(gd, block_kv: int, warps: int, stages: int, ppsm: int):
    """The grouped launcher's module constants, for a sweep point."""
    names = ("_BLOCK_KV", "_NUM_WARPS", "_NUM_STAGES", "_PROGRAMS_PER_SM")
    old = [getattr(gd, n) for n in names]
    for n, v in zip(names, (block_kv, warps, stages, ppsm)):
        setattr(gd, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, old):
            setattr(gd, n, v)


# --------------------------------------------------------------------------
# The check: both kernels and the forward path against float64 attention
# --------------------------------------------------------------------------


def check(env, preset: str) -> dict:
    """A decode step of CHECK_CACHED (tqbatches: context written, new tokens
    stored): both kernels against the float64 reference, the grouped kernel
    no worse than v0.33.0's (or within the output rounding); the forward
    path captured on dummy metadata, refilled, replayed == eager."""
    import tqbatches as tb

    shape = tb.Shape(
        hq=HQ, hk=HK, head=D, block=BLOCK, preset=preset, dtype=DTYPE,
        max_model_len=max(CHECK_CACHED) + 16,
    )  # fmt: skip
    with pytest_free_monkeypatch() as setattr_:
        backend = tb.open_backend(
            env.tree, env.models / f"check_{preset}", shape, setattr_
        )
        try:
            impl, layer, batch = tb.decode_batch(backend, CHECK_CACHED, seed=28)
            splits = env.gd.grouped_decode_num_splits(
                len(CHECK_CACHED), HK, 4096, tqlib.DEVICE
            )
            old, new = tb.decode_kernels(impl, layer, batch, splits, pad=1)
            want = torch.cat(tb.reference(batch, impl, layer))
            n = want.shape[0]
            err_old = (old[:n].reshape(want.shape).double().cpu() - want).abs().max()
            err_new = (new[:n].reshape(want.shape).double().cpu() - want).abs().max()
            rounding = tb.half_ulp(DTYPE, want)
            res = {
                "splits": splits,
                "err_up": float(err_old),
                "err_new": float(err_new),
                "half_ulp": rounding,
                "new_no_worse": bool(err_new <= max(err_old, rounding) * 1.01),
                "pad_row_zero": bool((new[n:] == 0).all()),
            }
            if env.peer is not None and preset == tqpeer.PRESET:
                res.update(tqpeer.check(env.peer, batch, impl, layer, BLOCK, want))
            res.update(replay_check(tb, backend, impl, layer, batch))
        finally:
            tb.close_backend()
    return res


@contextlib.contextmanager
def pytest_free_monkeypatch():
    """A setattr that is undone on exit (tqbatches.open_backend takes one)."""
    undo = []

    def setattr_(obj, name, value):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        yield setattr_
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


def replay_check(tb, backend, impl, layer, batch) -> dict:
    """Capture on the runner's dummy metadata, refill, replay (a CUDA graph
    on the GPU; the same calls eagerly on CPU) == an eager step, bits."""
    builder = backend.builder()
    captured, bufs = tb.capture_metadata(builder, batch)
    tb.forward(impl, layer, batch, captured)  # warm-up: compiles the kernels
    out = {}
    if tqlib.HAS_CUDA:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out["o"] = tb.forward(impl, layer, batch, captured)
        tb.refill(bufs, batch)
        graph.replay()
        tqlib.sync()
        replayed = out["o"].clone()
    else:
        tb.refill(bufs, batch)
        replayed = tb.forward(impl, layer, batch, captured)
    eager = tb.forward(impl, layer, batch, builder.build(0, batch.cam))
    err = tb.plain(eager).double().cpu()
    want = torch.cat(tb.reference(batch, impl, layer))
    return {
        "replay_equals_eager": bool(torch.equal(replayed, eager)),
        "fwd_err": float((err[: want.shape[0]] - want).abs().max()),
    }


# --------------------------------------------------------------------------
# One preset: config, impl, builder, a large cache
# --------------------------------------------------------------------------


class Preset:
    """The impl, layer and builder of one preset (the workspace reserved by
    the builder, then locked), and a cache of random bytes with finite
    norms and scales holding the largest cell that fits."""

    def __init__(self, env, preset: str, cells: list[tuple[int, int]]) -> None:
        self.preset, self.env = preset, env
        env.workspace.reset_workspace_manager()
        env.workspace.init_workspace_manager(tqlib.DEVICE)
        config = tqlib.make_config(
            env, hq=HQ, hk=HK, d=D, preset=preset, block_size=BLOCK,
            max_num_batched_tokens=8192, max_model_len=max(LENS) + BLOCK,
            max_num_seqs=max(BATCHES),
        )  # fmt: skip
        self.impl = tqlib.make_impl(env, config, preset, HQ, HK, D)
        self.builder = tqlib.make_builder(env, config, HQ, HK, D)
        self.layer = tqlib.make_layer(env, self.impl, D)
        self.impl._ensure_on_device(self.layer, tqlib.DEVICE)
        env.workspace.lock_workspace()
        self.cfg = self.impl.tq_config
        self.slot = h.tq_slot_size(preset, D)
        tokens = max(b * n for b, n in cells)
        self.num_blocks = tokens // BLOCK + 1
        cache = h.new_tq_kv_cache(
            self.num_blocks, BLOCK, HK, D, preset, generator=None, device=tqlib.DEVICE
        )
        self.runner, self.slots = cache.runner, cache.slots
        fill_fields(self.slots, self.cfg)

    def metadata(self, batch: int, length: int) -> dict:
        """Block table (random blocks), seq_lens, queries and the tree's
        metadata of a decode step of ``batch`` requests of ``length``."""
        g = torch.Generator(device=tqlib.DEVICE).manual_seed(batch * 7 + length)
        table = random_table(self.num_blocks, batch, length, BLOCK, g)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=tqlib.DEVICE)
        last = table[:, -1].long() * BLOCK + BLOCK - 1
        qsl = torch.arange(batch + 1, dtype=torch.int32)
        cam = h.common_attn_metadata(
            query_start_loc=qsl.to(tqlib.DEVICE), query_start_loc_cpu=qsl,
            seq_lens=seq_lens, num_reqs=batch, num_actual_tokens=batch,
            max_query_len=1, max_seq_len=length, block_table_tensor=table,
            slot_mapping=last, _seq_lens_cpu=seq_lens.cpu(),
            seq_lens_cpu_upper_bound=seq_lens.cpu(),
        )  # fmt: skip
        query = tqlib.rand((batch, HQ * D), DTYPE, g)
        return {"table": table, "seq_lens": seq_lens, "query": query,
                "meta": self.builder.build(0, cam)}  # fmt: skip


def random_table(
    num_blocks: int, batch: int, length: int, block: int, g: torch.Generator
) -> torch.Tensor:
    """A block table of ``batch`` requests of ``length`` tokens at distinct
    random blocks (block 0 left out); the last block of each partly used."""
    per = -(-length // block)
    perm = torch.randperm(num_blocks - 1, device=tqlib.DEVICE, generator=g)
    return (perm[: batch * per] + 1).view(batch, per).to(torch.int32)


def fill_fields(slots: torch.Tensor, cfg) -> None:
    """Finite fields in a cache of random bytes, in place: FP8 keys in
    (-2, 2) (the top exponent bit cleared: no NaN), key norms, value scales
    and zeros as the store gives N(0, 1) inputs."""
    flat = slots.view(-1, slots.shape[2], slots.shape[3])  # the cache itself
    d, hk = cfg.head_dim, slots.shape[2]
    levels = 2**cfg.effective_value_quant_bits - 1
    val = cfg.key_packed_size + math.ceil(d * cfg.effective_value_quant_bits / 8)
    step = 1 << 20
    for a in range(0, flat.shape[0], step):
        part = flat[a : a + step]
        r = torch.rand(part.shape[0], hk, device=part.device)
        if cfg.key_fp8:
            part[..., :d].bitwise_and_(0xBF)
        else:
            put_fp16(part, cfg.key_packed_size - 2, d**0.5 * (0.75 + r))
        scale = (4 + 2 * r) / levels
        put_fp16(part, val, scale)
        put_fp16(part, val + 2, -scale * levels / 2)


def put_fp16(part: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """fp16 ``values`` (n, Hk) into bytes offset, offset + 1 of each slot."""
    fp16 = values.to(torch.float16).view(torch.uint8).view(*values.shape, 2)
    part[..., offset : offset + 2] = fp16


# --------------------------------------------------------------------------
# The timed calls of one cell
# --------------------------------------------------------------------------


def decode_args(impl, layer, query, slots, table, seq_lens) -> dict:
    """The arguments both TurboQuant decode launchers take (but Pi, the
    split count and the buffers) for ``query`` [B, Hq, D] on the cache."""
    return {
        "query": query,
        "kv_cache": slots,
        "block_table": table,
        "seq_lens": seq_lens,
        **h.decode_params(layer, impl),
    }


def launchers(env, p: Preset, cell: dict, batch: int) -> dict:
    """The calls to time, each a closure over the cell's tensors: both
    launchers with workspace buffers as the decode path takes them, and
    the patched forward."""
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )

    ws = env.workspace.current_workspace_manager()
    q = cell["query"].view(batch, HQ, D)
    layer = p.layer
    common = decode_args(p.impl, layer, q, p.slots, cell["table"], cell["seq_lens"])

    def buffers(splits: int) -> dict:
        mid, out, lse = ws.get_simultaneous(
            ((batch, HQ, splits, D + 1), torch.float32),
            ((batch, HQ, D), DTYPE),
            ((batch, HQ), torch.float32),
        )
        return {"mid_o_buf": mid, "output_buf": out, "lse_buf": lse}

    up_splits = p.impl.max_num_kv_splits

    def up():
        return triton_turboquant_decode_attention(
            Pi=layer._tq_Pi, max_num_kv_splits=up_splits, **buffers(up_splits),
            **common,
        )  # fmt: skip

    budget = p.impl._max_num_reqs * up_splits // batch
    # The forward's split count (0010: of the preset's stage 1).
    regs = (
        (p.impl._grouped_in_registers,)
        if hasattr(p.impl, "_grouped_in_registers")
        else ()
    )
    s = env.gd.grouped_decode_num_splits(batch, HK, budget, tqlib.DEVICE, *regs)

    def new():
        return env.gd.triton_turboquant_grouped_decode_attention(
            num_kv_splits=s, **buffers(s), **common
        )

    kv = torch.zeros(batch, HK * D, dtype=DTYPE, device=tqlib.DEVICE)
    out = torch.empty(batch, HQ * D, dtype=DTYPE, device=tqlib.DEVICE)

    def fwd():
        p.impl.forward(layer, cell["query"], kv, kv, p.runner, cell["meta"], output=out)

    calls = {"up": up, "new": new, "fwd": fwd}
    if env.prev is not None:  # --prev: its own split count

        def prev():
            sp = env.prev.grouped_decode_num_splits(batch, HK, budget, tqlib.DEVICE)
            return env.prev.triton_turboquant_grouped_decode_attention(
                num_kv_splits=sp, **buffers(sp), **common
            )

        calls["prev"] = prev
    if getattr(p, "plane_kv", None):
        calls.update(plane_calls(env, p, common, buffers, budget, batch))
    return calls


def plane_calls(env, p: Preset, common: dict, buffers, budget: int, batch: int):
    """--plane: its decode on its copy of the cache, a call a variant."""
    s = env.plane.splits(batch, HK, budget, tqlib.DEVICE)
    args = {**common, "block_size": BLOCK}
    del args["kv_cache"]

    def at(v):
        def plane():
            return v.decode(p.plane_kv[v.layout, v.folded][0], HK, num_kv_splits=s,
                            **buffers(s), **args)  # fmt: skip

        return plane

    return {v.name: at(v) for v in plane_variants(env, p.cfg)}


def is_plane(name: str) -> bool:
    """A --plane variant's call or column (plane16w1s1, soa64w4s1c)."""
    return re.fullmatch(r"(plane|soa)\d+w\d+s\d+c?", name) is not None


def plane_variants(env, cfg) -> list:
    """--plane-configs K:W:S[:FLAGS] as the module's variants (FLAGS: ``s``
    its SoA layout, ``c`` folded norms; ``c`` only with MSE keys)."""
    out = []
    for k, w, n, *flags in env.plane_configs:
        flags = "".join(flags)
        if "c" in flags and cfg.key_fp8:
            continue
        layout = "soa" if "s" in flags else "plane"
        out.append(env.plane.Variant(f"{layout}{k}w{w}s{n}{'c' * ('c' in flags)}"))
    return out


def verify_calls(env, p: Preset, cell: dict, batch: int, row: dict) -> dict:
    """Speculative decoding's verification step, as the backend's small
    continuation launches it: a launch a request, a row a verified token
    (VERIFY of them, after L - VERIFY tokens), v0.33.0's kernel at its
    default splits and the grouped one at the continuation's. ``row`` gets
    the relative L2 difference of their outputs."""
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        triton_turboquant_decode_attention,
    )

    g = torch.Generator(device=tqlib.DEVICE).manual_seed(batch)
    q = tqlib.rand((batch, VERIFY, HQ, D), DTYPE, g)
    step = torch.arange(1 - VERIFY, 1, device=tqlib.DEVICE, dtype=torch.int32)
    table, seq = cell["table"], cell["seq_lens"]
    args = [
        decode_args(
            p.impl, p.layer, q[r], p.slots, table[r : r + 1].expand(VERIFY, -1),
            seq[r] + step,
        )
        for r in range(batch)
    ]  # fmt: skip
    splits = env.gd.grouped_decode_num_splits(
        VERIFY, HK, p.impl.max_num_kv_splits, tqlib.DEVICE
    )

    def up():
        return [
            triton_turboquant_decode_attention(Pi=p.layer._tq_Pi, **a) for a in args
        ]

    def new():
        return [
            env.gd.triton_turboquant_grouped_decode_attention(num_kv_splits=splits, **a)
            for a in args
        ]

    a, b = torch.cat(up()).double(), torch.cat(new()).double()
    row["verify_rel_diff"] = ((a - b).norm() / a.norm()).item()
    return {"up_verify": up, "new_verify": new}


def fa2_calls(kv: torch.Tensor | None, batch: int, length: int) -> dict:
    """bf16 FA2 decode over ``batch`` x ``length`` tokens of ``kv`` (2, B * L,
    Hk, D): the dense batch and the varlen form."""
    if kv is None or kv.shape[1] < batch * length:
        return {}
    g = torch.Generator(device=tqlib.DEVICE).manual_seed(batch + length)
    q = tqlib.rand((batch, 1, HQ, D), DTYPE, g)
    k = kv[0, : batch * length].view(batch, length, HK, D)
    v = kv[1, : batch * length].view(batch, length, HK, D)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=tqlib.DEVICE)
    cu_k = cu_q * length
    fa = torch.ops.aten._flash_attention_forward
    scale = D**-0.5

    def dense():
        fa(q, k, v, None, None, 1, length, 0.0, False, False, scale=scale)

    def varlen():
        fa(
            q.view(batch, HQ, D), k.view(-1, HK, D), v.view(-1, HK, D), cu_q, cu_k,
            1, length, 0.0, False, False, scale=scale,
        )  # fmt: skip

    return {"fa2": dense, "fa2v": varlen}


def run_cell(env, p: Preset, kv, batch: int, length: int, flush, best) -> dict:
    row = {"preset": p.preset, "B": batch, "L": length}
    bw = env.ceil["copy_bytes_per_s"]
    row["floor_ms"] = batch * length * HK * p.slot / bw * 1e3
    row["fa2_floor_ms"] = batch * length * HK * D * 2 * 2 / bw * 1e3
    cell = p.metadata(batch, length)
    calls = launchers(env, p, cell, batch)
    peer_and_errors(env, p, cell, (batch, length), calls, row)
    for name in [n for n in calls if is_plane(n)]:  # the same arithmetic
        want = calls["new"]().float().clone()
        row[f"{name}_vs_new"] = float((calls[name]().float() - want).abs().max())
    if VERIFY:
        calls.update(verify_calls(env, p, cell, batch, row))
    if tqlib.HAS_CUDA:
        calls.update(fa2_calls(kv, batch, length))
    for name, fn in calls.items():
        try:
            row[name] = graph_time(fn, flush, REPS)["median_ms"]
        except Exception as e:  # record, go on
            row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
            env.errors.append(traceback.format_exc()[-1500:])
    if best is not None:
        with kernel_config(env.gd, *best):
            row["best"] = graph_time(calls["new"], flush, REPS)["median_ms"]
    print(f"  {p.preset} B={batch} L={length}: " + ", ".join(
        f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)
    ), flush=True)  # fmt: skip
    return row


def peer_and_errors(env, p: Preset, cell: dict, bl: tuple, calls: dict, row) -> None:
    """The peer's calls into ``calls`` (where its cache is), and with
    --errors every kernel's error against float64 into ``row``."""
    batch, length = bl
    q = cell["query"].view(batch, HQ, D)
    if getattr(p, "peer_kv", None) is not None:
        fns, meta = tqpeer.calls(
            env.peer, p.peer_kv, p.layer, q, cell["table"], cell["seq_lens"],
            length, BLOCK,
        )  # fmt: skip
        calls.update(fns)
        row.update(meta)
    if ERRORS:
        names = [n for n in ("up", "new", "peer", "peer_mma", "prev") if n in calls]
        names += [n for n in calls if is_plane(n)]
        ref = tqpeer.reference_shape(p.impl, p.layer, p.slots, HQ, BLOCK)
        fns = {n: calls[n] for n in names}
        row.update(tqpeer.errors(ref, q, cell["table"], length, fns))
        for (layout, _), (_, norms) in getattr(p, "plane_kv", {}).items():
            if norms is None:  # the others' reference holds
                continue
            own = {n: fn for n, fn in fns.items()
                   if n.startswith(layout) and n.endswith("c")}  # fmt: skip
            mine = SimpleNamespace(
                reference=functools.partial(ref.reference, norms=norms)
            )
            got = tqpeer.errors(mine, q, cell["table"], length, own)
            row.update({f"{k}_own": v for k, v in got.items() if k.startswith("err")})


# --------------------------------------------------------------------------
# The sweep of the grouped kernel's configuration
# --------------------------------------------------------------------------


def sweep(env, p: Preset, flush, deadline: float) -> dict:
    """BLOCK_KV x num_warps x programs per SM on SWEEP_CELLS (those that
    fit): every point's times, and the best by their geometric mean."""
    cells = [c for c in SWEEP_CELLS if c[0] * c[1] < p.num_blocks * BLOCK]
    points = []
    for (bkv, warps, stages), ppsm in itertools.product(SWEEP_KERNELS, SWEEP_PPSM):
        if time.time() > deadline or not cells:
            break
        times = []
        try:
            with kernel_config(env.gd, bkv, warps, stages, ppsm):
                for b, n in cells:
                    new = launchers(env, p, p.metadata(b, n), b)["new"]
                    times.append(graph_time(new, flush, REPS)["median_ms"])
        except Exception as e:  # a configuration that does not compile
            point = [bkv, warps, stages, ppsm]
            points.append({"config": point, "error": str(e)[:200]})
            continue
        geo = math.exp(statistics.fmean(math.log(t) for t in times))
        point = [bkv, warps, stages, ppsm]
        points.append({"config": point, "ms": times, "geomean": geo})
        print(f"  sweep {p.preset} {point}: {geo:.3f}", flush=True)
    ok = [x for x in points if "geomean" in x]
    best = min(ok, key=lambda x: x["geomean"])["config"] if ok else None
    return {"cells": cells, "points": points, "best": best}


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def fitting_cells(preset: str, copies: int = 1) -> tuple[list, int]:
    """Cells whose TurboQuant cache (``copies`` of it: 2 with the peer's
    layout) fits in half the free memory, and the tokens of bf16 K/V that
    fit in what is left (0 on CPU)."""
    slot = h.tq_slot_size(preset, D) * copies
    cells = list(itertools.product(BATCHES, LENS))
    if not tqlib.HAS_CUDA:
        return cells, 0
    free = torch.cuda.mem_get_info()[0] - (4 << 30)
    cells = [(b, n) for b, n in cells if b * n * HK * slot <= free // 2]
    tq_bytes = max(b * n for b, n in cells) * HK * slot
    left = free - tq_bytes - FLUSH_BYTES
    fits = [b * n for b, n in itertools.product(BATCHES, LENS)
            if b * n * HK * D * 4 <= left]  # fmt: skip
    return cells, max(fits, default=0)


def run_preset(env, preset: str, args, flush, res: dict) -> None:
    peer = env.peer is not None and preset == tqpeer.PRESET
    plane = env.plane is not None and preset in env.plane.PRESETS
    cfg = h.tq_config(preset, D)
    kinds = {(v.layout, v.folded) for v in plane_variants(env, cfg)} if plane else ()
    copies = 1 + peer + len(kinds)
    cells, fa_tokens = fitting_cells(preset, copies)
    if args.cells:
        cells = [c for c in cells if c in args.cells]
    if not cells:  # none of --cells fits (or is this preset's)
        res["not_run"].append([preset])
        return
    t0 = time.time()
    res["checks"][preset] = check(env, preset)
    print(f"[{preset}] check {res['checks'][preset]}", flush=True)
    p = Preset(env, preset, cells)
    if peer:
        p.peer_kv = tqpeer.to_peer_layout(p.slots, p.cfg)
    if plane:  # a converted cache (and folded norms or None) a layout
        cen, by_kind = p.layer._tq_centroids, {}
        for v in plane_variants(env, p.cfg):
            if (v.layout, v.folded) not in by_kind:
                by_kind[v.layout, v.folded] = v.convert(p.slots, p.cfg, cen)
        p.plane_kv = by_kind
    kv = None
    if fa_tokens:
        kv = torch.empty(2, fa_tokens, HK, D, dtype=DTYPE, device=tqlib.DEVICE)
        kv.normal_()
    best = None
    if args.sweep:
        # An equal share of the sweep's time for this preset and the rest.
        left = len(PRESETS) - PRESETS.index(preset)
        end = t0 + (args.t_end - 60 - t0) / left
        res["sweeps"][preset] = sweep(env, p, flush, end)
        best = res["sweeps"][preset]["best"]
    for b, n in sorted(cells, key=lambda c: c[0] * c[1]):
        if time.time() > args.t_end:
            res["not_run"].append([preset, b, n])
            continue
        res["rows"].append(run_cell(env, p, kv, b, n, flush, best))
    res["preset_s"][preset] = time.time() - t0
    del p, kv
    env.workspace.reset_workspace_manager()
    if tqlib.HAS_CUDA:
        torch.cuda.empty_cache()


def table(res: dict) -> str:
    rows = res["rows"]
    peer = any("peer" in r or "peer_mma" in r for r in rows)
    cols = ("floor_ms", "up", "new", "fwd", "best", "fa2", "fa2v")
    cols += ("peer", "peer_mma") if peer else ()
    cols += ("prev",) if any("prev" in r for r in rows) else ()
    planes = sorted({k for r in rows for k in r if is_plane(k)})
    cols += tuple(planes)
    ratios = ("new/floor", "new/fa2", "up/new") + (
        ("peer/fa2", "new/peer") if peer else ()
    )
    ratios += ("plane/floor", "plane/fa2", "plane/new") if planes else ()
    head = "| preset | B | L | " + " | ".join(cols + ratios) + " |"
    device = res["device"].get("device")
    bw = res["ceilings"]["copy_bytes_per_s"] / 1e12
    title = f"### TurboQuant decode, ms ({device}, copy {bw:.2f} TB/s)"
    lines = [title, "", head, "|" + "---|" * (len(cols) + len(ratios) + 3)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r.get(c), float) else "-" for c in cols]
        fast = min(r.get("new", math.inf), r.get("best", math.inf))
        ratio = [fast / r["floor_ms"], fast / r.get("fa2", math.nan),
                 r.get("up", math.nan) / fast]  # fmt: skip
        if peer:  # the faster of its two paths
            both = [r[k] for k in ("peer", "peer_mma") if isinstance(r.get(k), float)]
            top = min(both, default=math.nan)
            ratio += [top / r.get("fa2", math.nan), fast / top]
        if planes:  # the fastest plane config against the floor and FA2
            top = min((r[k] for k in planes if isinstance(r.get(k), float)),
                      default=math.nan)  # fmt: skip
            ratio += [top / r["floor_ms"], top / r.get("fa2", math.nan), top / fast]
        lines.append(
            f"| {r['preset'].removeprefix('turboquant_')} | {r['B']} | {r['L']} | "
            + " | ".join(
                cells + [f"{x:.2f}" if math.isfinite(x) else "-" for x in ratio]
            )
            + " |"
        )
    lines += error_lines(rows)
    for preset, s in res["sweeps"].items():
        lines.append(f"\nsweep {preset}: best (BLOCK_KV, warps, stages, programs/SM) "
                     f"{s['best']} of {len(s['points'])}")  # fmt: skip
    for preset, c in res["checks"].items():
        lines.append(f"check {preset}: {json.dumps(c)}")
    return "\n".join(lines) + "\n"


def error_lines(rows: list) -> list[str]:
    """The relative L2 errors against float64 (--errors), a row a cell."""
    names = [n for n in ("up", "new", "peer", "peer_mma", "prev")
             if any(f"err_{n}" in r for r in rows)]  # fmt: skip
    variants = {k[4:] for r in rows for k in r if k.startswith("err_")}
    names += sorted(n for n in variants if is_plane(n.removesuffix("_own")))
    if not names:
        return []
    out = ["", "relative L2 error against float64 (requests 0 and B - 1):", "",
           "| preset | B | L | " + " | ".join(names) + " |",
           "|" + "---|" * (len(names) + 3)]  # fmt: skip
    for r in rows:
        errs = [r.get(f"err_{n}", "-") for n in names]
        errs = [f"{e:.2e}" if isinstance(e, float) else str(e)[:40] for e in errs]
        out.append(f"| {r['preset'].removeprefix('turboquant_')} | {r['B']} | "
                   f"{r['L']} | " + " | ".join(errs) + " |")  # fmt: skip
    return out


def main() -> int:
    args = parse_args()
    args.t_end = time.time() + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = tqlib.use_tree(args.tree)
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    env.gd, env.errors, env.prev = gd, [], None
    if args.prev:
        env.prev = tqlib.load_module("prev_grouped_decode", args.prev)
    env.peer = tqpeer.try_build(args.peer, env.errors) if args.peer else None
    env.plane = tqlib.load_module("plane_decode", args.plane) if args.plane else None
    env.plane_configs = [c.split(":") for c in args.plane_configs.split(",")]
    env.ceil = tqlib.ceilings()
    res = {
        "device": tqlib.device_info(),
        "ceilings": env.ceil,
        "tree": str(env.tree),
        "shape": {"Hq": HQ, "Hk": HK, "D": D, "block": BLOCK, "reps": REPS},
        "defaults": [
            gd._MSE_CONFIG,
            gd._K3V4_CONFIG,
            gd._FP8_CONFIG,
            gd._PROGRAMS_PER_SM,
        ],
        "checks": {},
        "sweeps": {},
        "rows": [],
        "not_run": [],
        "preset_s": {},
        "peer": env.peer.info if env.peer is not None else None,
        "argv": sys.argv[1:],
    }
    print(f"ceilings {env.ceil}", flush=True)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=tqlib.DEVICE)
    for preset in PRESETS:
        try:
            run_preset(env, preset, args, flush, res)
        except Exception:
            env.errors.append(traceback.format_exc()[-3000:])
            print(env.errors[-1], flush=True)
    if env.plane is not None and tqlib.HAS_CUDA:
        res["plane_compiled"] = env.plane.compiled_info()
        print(f"plane stage 1 compiled: {res['plane_compiled']}", flush=True)
    res["errors"] = env.errors
    (out / "tq_decode_bench.json").write_text(json.dumps(res, indent=1, default=str))
    text = table(res)
    (out / "tq_decode_table.md").write_text(text)
    print(text)
    return 0 if not env.errors else 1


if __name__ == "__main__":
    sys.exit(main())
