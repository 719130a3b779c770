"""TurboQuant decode accuracy at production shapes (issue 35): v0.33.0's
decode kernel, the grouped split-K kernel of tq-v0.33/0009 and proposed
variants of it side by side in ONE process, each against float64 attention
over the K/V decoded from the cache bytes.

The tree (``--tree``, tq33-patched) gives vLLM, the impl, the layer's
rotation and centroids and the grouped kernel (``0009``). v0.33.0's kernel
(``up``) is its own module file (``--base-kernel``: v0.33.0's
``triton_turboquant_decode.py``, sha256 recorded), each variant
(``--variant NAME=FILE``) a grouped-decode module file, loaded beside them.

Cells: presets x D x GQA (Hk 4, Hq 4 x GQA) x B x L (every request L tokens),
bf16 queries, block 16 (``--block``); a cache of random bytes with finite norms and
scales (tq_decode_bench.fill_fields) at random blocks. The grouped kernels
take the split count the patched forward takes (max_num_seqs 256, 32
splits reserved a request); v0.33.0's its 32. Error: relative L2 of the
attention output of up to ``--rows`` requests of the batch (evenly spread;
every request runs) against the reference, computed on the GPU in float64,
in chunks of tokens, with an online softmax. Bound per cell and kernel:
err <= max(1.25 x err_up, err_up + 2e-4). Each kernel is also timed (CUDA
graph, L2 flushed, median of ``--reps``). The sweep: the grouped kernels
at forced split counts on one cell (tokens per split from L to L / 128).

    python ci/gpu/tq_decode_accuracy.py --tree T --base-kernel F \\
        [--variant fixed=F ...] --out DIR [--presets 4bit_nc,k8v4] \\
        [--dims 128,256] [--gqa 4,16] [--cells 8x131072,...] [--small] \\
        [--ragged]

Writes DIR/tq_decode_accuracy.json (after every shape) and
DIR/tq_decode_accuracy.md (printed last). --small: CPU shapes in Triton's
interpreter, a sanity run.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import tq_attention_data as data
import tq_decode_bench as bench
import tq_goal as goal
import tqlib
from tqlib import h

HK, BLOCK, DTYPE = 4, 16, torch.bfloat16
MAX_NUM_SEQS, UP_SPLITS = 256, 32
PRESETS = ("4bit_nc", "k8v4", "3bit_nc", "k3v4_nc")
DIMS = (256, 128)
GQAS = (4, 16)
CELLS = ((1, 131072), (8, 131072), (32, 131072), (128, 32768), (128, 131072))
SWEEP = ("4bit_nc", 256, 4, (128, 131072))
SWEEP_SPLITS = (1, 3, 8, 32, 128)
ROWS, CHUNK, REPS = 8, 16384, 10
DATA = [("flat", "normal")]
RAGGED = False  # --ragged: a served batch's mixed lengths


def parse_args() -> argparse.Namespace:
    global HK, BLOCK, PRESETS, DIMS, GQAS, CELLS, SWEEP, SWEEP_SPLITS, ROWS, CHUNK, REPS
    global DTYPE, DATA, RAGGED
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--base-kernel", required=True, help="v0.33.0's module file")
    ap.add_argument("--variant", action="append", default=[], help="NAME=FILE")
    ap.add_argument("--tree-name", default="0009", help="the tree's grouped decode")
    ap.add_argument("--tree-variant", help="FILE: the tree's column through it")
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", help="comma list without turboquant_")
    ap.add_argument("--dims", help="comma list of head sizes")
    ap.add_argument("--gqa", help="comma list of Hq / Hk")
    ap.add_argument("--cells", help="BxL,... (requests x tokens)")
    ap.add_argument("--sweep", help="PRESET:D:GQA:BxL, or 'none'")
    ap.add_argument("--sweep-splits", help="comma list of split counts")
    ap.add_argument("--block", type=int, help="tokens a KV cache block (16)")
    ap.add_argument("--rows", type=int, help="requests checked a cell")
    ap.add_argument("--reps", type=int, help="timed replays a kernel")
    ap.add_argument("--deadline", type=float, default=540, help="seconds")
    ap.add_argument("--small", action="store_true", help="CPU sanity shapes")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--data", help="ATTN:VALUES,... (tq_attention_data.py)")
    ap.add_argument("--hk", type=int, help="KV heads (4)")
    ap.add_argument("--fa2", action="store_true", help="time FA2 and the floor too")
    ap.add_argument("--goal", help="the kernel held to issue 54's goals (--fa2)")
    ap.add_argument("--ragged", action="store_true",
                    help="requests of 1/8 to all of L tokens (not with --fa2)")
    a = ap.parse_args()
    DTYPE = getattr(torch, a.dtype)
    if a.small:
        HK, PRESETS, DIMS, GQAS = 1, ("4bit_nc", "k8v4"), (64,), (4,)
        CELLS, SWEEP = ((2, 96),), ("4bit_nc", 64, 4, (2, 96))
        SWEEP_SPLITS, ROWS, CHUNK, REPS = (1, 2), 2, 40, 1
    PRESETS = tuple(a.presets.split(",")) if a.presets else PRESETS
    DIMS = tuple(int(x) for x in a.dims.split(",")) if a.dims else DIMS
    GQAS = tuple(int(x) for x in a.gqa.split(",")) if a.gqa else GQAS
    if a.cells:
        CELLS = tuple(bench.parse_cell(c) for c in a.cells.split(","))
    if a.sweep == "none":
        SWEEP = None
    elif a.sweep:
        p, d, g, cell = a.sweep.split(":")
        SWEEP = (p, int(d), int(g), bench.parse_cell(cell))
    if a.sweep_splits:
        SWEEP_SPLITS = tuple(int(x) for x in a.sweep_splits.split(","))
    ROWS, REPS, BLOCK = a.rows or ROWS, a.reps or REPS, a.block or BLOCK
    DATA, HK = data.parse(a.data) if a.data else DATA, a.hk or HK
    if a.ragged and a.fa2:
        ap.error("--ragged times FA2 and the floor at L: leave out --fa2")
    RAGGED = a.ragged
    return a


# --------------------------------------------------------------------------
# The kernels: v0.33.0's, 0009's and the variants, as modules
# --------------------------------------------------------------------------


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def kernels(args, gd: ModuleType) -> tuple[ModuleType, dict, dict]:
    """v0.33.0's module, {name: grouped module} (the tree's first, named
    --tree-name), and where each came from (file, sha256)."""
    up = tqlib.load_module("tq_accuracy_up", args.base_kernel)
    files = {"up": [args.base_kernel, sha256(args.base_kernel)]}
    files[args.tree_name] = [gd.__file__, sha256(gd.__file__)]
    if args.tree_variant:  # e.g. the tree's decode on the pages its backend stores
        gd = tqlib.load_module("tq_accuracy_tree", args.tree_variant)
        files[args.tree_name].append(args.tree_variant)
        if hasattr(gd, "configure"):  # tq_soa_tree.py: $TQ_SOA_<tree name>
            gd.configure(args.tree_name)
    grouped = {args.tree_name: gd}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        grouped[name] = tqlib.load_module(f"tq_accuracy_{name}", path)
        if hasattr(grouped[name], "configure"):  # one file, many variants
            grouped[name].configure(name)
        files[name] = [path, sha256(path)]
    return up, grouped, files


# --------------------------------------------------------------------------
# One shape (preset, D, GQA): impl, layer and the float64 decode
# --------------------------------------------------------------------------


class Shape:
    """The impl and layer (rotation, centroids) of a preset at head size
    ``d`` with Hq = gqa x HK, and the cache it reads."""

    def __init__(self, env, preset: str, d: int, gqa: int, cache) -> None:
        self.preset, self.d, self.gqa, self.hq = preset, d, gqa, gqa * HK
        config = tqlib.make_config(
            env, hq=self.hq, hk=HK, d=d, preset=f"turboquant_{preset}",
            block_size=BLOCK, max_num_batched_tokens=8192,
            max_model_len=max(n for _, n in CELLS) + BLOCK,
            max_num_seqs=MAX_NUM_SEQS,
        )  # fmt: skip
        full = f"turboquant_{preset}"
        self.impl = tqlib.make_impl(env, config, full, self.hq, HK, d)
        self.layer = tqlib.make_layer(env, self.impl, d)
        self.impl._ensure_on_device(self.layer, tqlib.DEVICE)
        self.cfg, self.cache = self.impl.tq_config, cache
        self.hadamard = tb().__dict__["_hadamard"](d).to(tqlib.DEVICE)
        self.centroids = self.layer._tq_centroids.double()

    def dequant(
        self, raw: torch.Tensor, norms: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (n, Hk, D) float64 of slot bytes ``raw`` (n, Hk, slot) on the
        device: tqbatches.dequant's decoding, its Hadamard on the device;
        with ``norms`` (n, Hk) the keys' norms corrected (norm / ||c||) in
        place of the slots' norms and their correction."""
        t, cfg, d = tb(), self.cfg, self.d
        b = raw.to(torch.int32)
        if cfg.key_fp8:
            k = raw[..., :d].contiguous().view(torch.float8_e4m3fn).double()
        else:
            mse = math.ceil(d * cfg.key_mse_bits / 8)
            c = self.centroids[unpack(b, 0, cfg.key_mse_bits, d).long()]
            if norms is not None:
                k = (norms.double().unsqueeze(-1) * c) @ self.hadamard
            else:
                if cfg.norm_correction:
                    c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
                norm = t._f16(raw[..., mse : mse + 2]).unsqueeze(-1)
                k = (norm * c) @ self.hadamard
        base, bits = cfg.key_packed_size, cfg.effective_value_quant_bits
        nbytes = math.ceil(d * bits / 8)
        idx = unpack(b, base, bits, d).double()
        scale = t._f16(raw[..., base + nbytes : base + nbytes + 2]).unsqueeze(-1)
        zero = t._f16(raw[..., base + nbytes + 2 : base + nbytes + 4]).unsqueeze(-1)
        return k, idx * scale + zero

    def reference(self, q: torch.Tensor, table_row: torch.Tensor, n: int,
                  norms: torch.Tensor | None = None):  # fmt: skip
        """Float64 attention of one request's query (Hq, D) over its ``n``
        tokens, in chunks of CHUNK tokens with an online softmax (``norms``:
        the cache's corrected norms (blocks, block, Hk), see dequant)."""
        qq = q.double().view(HK, self.gqa, self.d)
        m = torch.full((HK, self.gqa, 1), -math.inf, dtype=torch.float64,
                       device=q.device)  # fmt: skip
        l_sum = torch.zeros_like(m)
        acc = torch.zeros_like(qq)
        for a in range(0, n, CHUNK):
            pos = torch.arange(a, min(n, a + CHUNK), device=q.device)
            blocks = table_row[pos // BLOCK].long()
            fixed = None if norms is None else norms[blocks, pos % BLOCK]
            k, v = self.dequant(self.cache.slots[blocks, pos % BLOCK], fixed)
            s = torch.einsum("hgd,thd->hgt", qq, k) * self.impl.scale
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.einsum("hgt,thd->hgd", p, v)
            m = m_new
        return (acc / l_sum).reshape(self.hq, self.d)


def unpack(b: torch.Tensor, base: int, bits: int, head: int) -> torch.Tensor:
    """tqbatches._unpack with its offsets on ``b``'s device (the harness
    builds them on the CPU): ``head`` little-endian ``bits``-bit codes from
    byte ``base``."""
    off = torch.arange(head, device=b.device) * bits
    word = b[..., base + off // 8] | (b[..., base + off // 8 + 1] << 8)
    return (word >> (off % 8)) & ((1 << bits) - 1)


def tb() -> ModuleType:
    import tqbatches

    return tqbatches


def dequant_matches_harness(shape: Shape) -> float:
    """Max |difference| between Shape.dequant and tqbatches.dequant (the
    tests' CPU float64 decoding) over the slots of a small cache."""
    small = h.new_tq_kv_cache(
        3, BLOCK, HK, shape.d, f"turboquant_{shape.preset}", generator=None,
        device=tqlib.DEVICE,
    )  # fmt: skip
    bench.fill_fields(small.slots, shape.cfg)
    ids = torch.arange(BLOCK, 3 * BLOCK)
    k0, v0 = tb().dequant(small.slots, ids, shape.cfg, shape.layer._tq_centroids)
    raw = small.slots.reshape(-1, HK, small.slots.shape[-1])[ids.to(tqlib.DEVICE)]
    k1, v1 = shape.dequant(raw)
    return float(max((k1.cpu() - k0).abs().max(), (v1.cpu() - v0).abs().max()))


# --------------------------------------------------------------------------
# One cell: every kernel's output and time, the reference of sampled rows
# --------------------------------------------------------------------------


def tokens_per_split(length: int, splits: int, block_kv: int) -> int:
    """Tokens one program walks (the grouped kernels' split length)."""
    return math.ceil(math.ceil(length / splits) / block_kv) * block_kv


def request_lengths(batch: int, length: int, g: torch.Generator) -> list[int]:
    """Every request ``length`` tokens; with --ragged, 1/8 to all of it (a
    fixed uniform draw), as in a served batch."""
    if not RAGGED:
        return [length] * batch
    u = torch.rand(batch, generator=g, device=g.device).tolist()
    return [max(1, round(length * (1 - 7 * x / 8))) for x in u]


def sampled_rows(batch: int) -> list[int]:
    if batch <= ROWS:
        return list(range(batch))
    return sorted({round(i * (batch - 1) / (ROWS - 1)) for i in range(ROWS)})


class Cell:
    """A decode step of ``batch`` requests of ``length`` tokens: inputs,
    buffers for either kernel, the float64 reference of sampled rows."""

    def __init__(self, shape: Shape, num_blocks: int, batch: int, length: int,
                 attention: str = "flat"):  # fmt: skip
        self.shape, self.batch, self.length = shape, batch, length
        g = torch.Generator(device=tqlib.DEVICE).manual_seed(batch * 7 + length)
        table = bench.random_table(num_blocks, batch, length, BLOCK, g)
        self.lens = request_lengths(batch, length, g)
        seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=tqlib.DEVICE)
        q = tqlib.rand((batch, shape.hq, shape.d), DTYPE, g)
        self.rows = sampled_rows(batch)
        for r in self.rows:  # the checked requests' queries (the rest: random)

            def keys(pos: torch.Tensor, r: int = r) -> torch.Tensor:
                blocks = table[r][pos // BLOCK].long()
                return shape.dequant(shape.cache.slots[blocks, pos % BLOCK])[0]

            data.aim(q[r], keys, self.lens[r], attention, shape.impl.scale)
        self.args = bench.decode_args(
            shape.impl, shape.layer, q, shape.cache.slots, table, seq_lens
        )
        self.q, self.table = q, table
        t0 = time.time()
        self.ref = self.reference()
        self.ref_s = time.time() - t0

    def reference(self, norms: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled rows' float64 attention (``norms``: Shape.dequant's)."""
        return torch.stack([
            self.shape.reference(self.q[r], self.table[r], self.lens[r], norms)
            for r in self.rows
        ])  # fmt: skip

    def buffers(self, splits: int) -> dict:
        b, hq, d = self.batch, self.shape.hq, self.shape.d
        dev = tqlib.DEVICE
        return {
            "mid_o_buf": torch.empty(b, hq, splits, d + 1, device=dev),
            "output_buf": torch.empty(b, hq, d, dtype=DTYPE, device=dev),
            "lse_buf": torch.empty(b, hq, device=dev),
        }

    def errors(self, out: torch.Tensor, ref: torch.Tensor | None = None) -> dict:
        """The output's errors on the sampled rows against ``ref`` (else the
        cell's reference)."""
        ref = self.ref if ref is None else ref
        got = out[self.rows].double()
        diff = got - ref
        return {
            # which kernels gave the same output bit for bit (``same_lines``)
            "digest": hashlib.sha1(
                out.contiguous().view(torch.uint8).cpu().numpy()
            ).hexdigest()[:16],
            "err": float(diff.norm() / ref.norm()),
            "max_abs": float(diff.abs().max()),
            "bias": float(diff.mean() / diff.pow(2).mean().sqrt().clamp_min(1e-300)),
            "finite": bool(torch.isfinite(got).all()),
        }

    def measure(self, fn, flush, ref: torch.Tensor | None = None) -> dict:
        """Run ``fn`` (returns the output), its errors, then its time."""
        res = self.errors(fn().clone(), ref)
        try:
            res["ms"] = bench.graph_time(fn, flush, REPS)["median_ms"]
        except Exception as e:  # the error is what counts: record, go on
            res["time_error"] = f"{type(e).__name__}: {e}"[:200]
        return res

    def up(self, module: ModuleType, flush) -> dict:
        bufs = self.buffers(UP_SPLITS)
        layer = self.shape.layer

        def fn():
            return module.triton_turboquant_decode_attention(
                Pi=layer._tq_Pi, max_num_kv_splits=UP_SPLITS, **bufs, **self.args
            )

        res = self.measure(fn, flush)
        res.update(splits=UP_SPLITS, tokens_per_split=math.ceil(self.length / 32))
        return res

    def grouped(self, module: ModuleType, splits: int, flush) -> dict:
        bufs = self.buffers(splits)

        def fn():
            return module.triton_turboquant_grouped_decode_attention(
                num_kv_splits=splits, **bufs, **self.args
            )

        ref, vs_cache = None, None
        norms_of = getattr(module, "reference_norms", None)
        if norms_of is not None:  # a cache of its own: its norms may differ
            out = fn().clone()
            norms = norms_of(self.shape.cache.slots)
            if norms is not None:  # its error against the cell's reference too
                ref, vs_cache = self.reference(norms), self.errors(out)["err"]
        res = self.measure(fn, flush, ref)
        if vs_cache is not None:
            res["err_vs_cache"] = vs_cache
        if getattr(module, "OWN_SPLITS", False):  # its own plan, not the suite's
            res.update(splits=None, tokens_per_split=None)
            return res
        cfg = self.shape.cfg
        bkv = module._config(
            cfg.key_fp8, cfg.key_mse_bits, cfg.effective_value_quant_bits
        )[0]
        res.update(splits=splits, tokens_per_split=tokens_per_split(
            self.length, splits, bkv))  # fmt: skip
        return res


def forward_splits(gd: ModuleType, batch: int, shape: Shape) -> int:
    """The split count the patched forward takes for ``batch`` requests
    (with 0010, of the preset's stage 1; with 0012, of the shape's)."""
    budget = MAX_NUM_SEQS * UP_SPLITS // max(batch, 1)
    regs = getattr(gd, "grouped_decode_in_registers", None)
    if regs is None:
        return gd.grouped_decode_num_splits(batch, HK, budget, tqlib.DEVICE)
    cfg = shape.cfg
    args = [cfg.key_fp8, cfg.key_mse_bits, cfg.effective_value_quant_bits, DTYPE]
    if "head_dim" in inspect.signature(regs).parameters:
        args += [shape.d, shape.gqa]
    in_registers = regs(*args)
    return gd.grouped_decode_num_splits(batch, HK, budget, tqlib.DEVICE, in_registers)


def bound(err_up: float) -> float:
    return max(1.25 * err_up, err_up + 2e-4)


def within(res: dict, up: dict, ref_max: float) -> bool:
    """The suite's bound: relative L2 and max abs error at most 1.25x
    v0.33.0's (or its + 2e-4 of the output's scale), and no one-sided error
    (|mean / RMS| <= 0.3) where v0.33.0's has none."""
    slack = 2e-4 * ref_max
    return bool(
        res["finite"]
        and res["err"] <= bound(up["err"])
        and res["max_abs"] <= max(1.25 * up["max_abs"], up["max_abs"] + slack)
        and (abs(res["bias"]) <= 0.3 or abs(up["bias"]) > 0.3)
    )


def run_cell(env, shape: Shape, num_blocks: int, batch: int, length: int,
             splits: int | None = None, mode=("flat", "normal")) -> dict:  # fmt: skip
    """Every kernel on one cell; ``splits`` forces the grouped kernels'."""
    cell = Cell(shape, num_blocks, batch, length, mode[0])
    row = {"preset": shape.preset, "D": shape.d, "GQA": shape.gqa, "B": batch,
           "L": length, "rows": cell.rows, "ref_s": cell.ref_s,
           "data": ":".join(mode)}  # fmt: skip
    row["up"] = cell.up(env.up, env.flush)
    limit = bound(row["up"]["err"])
    ref_max = float(cell.ref.abs().max())
    for name, module in env.grouped.items():
        serves = getattr(module, "serves", None)
        if serves and not serves(shape.cfg, DTYPE, shape.d, shape.gqa):
            continue
        s = splits or forward_splits(module, batch, shape)
        try:
            res = cell.grouped(module, s, env.flush)
        except Exception as e:  # e.g. Triton's OutOfResources: recorded
            msg = f"{type(e).__name__}: {e}"[:400]
            res = {"err": math.nan, "splits": s, "tokens_per_split": None,
                   "finite": False, "error": msg}  # fmt: skip
        res["within_bound"] = "bias" in res and within(res, row["up"], ref_max)
        row[name] = res
    row["bound"] = limit
    if env.fa2_ms is not None:
        row.update(goal.times(env, shape, batch, length, REPS))
    print("  " + brief(row), flush=True)
    del cell
    return row


def same_lines(rows: list[dict], names: list[str]) -> list[str]:
    """For each pair of grouped kernels run on the same cells: in how many
    their outputs were equal bit for bit."""
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = [r for r in rows if "digest" in r.get(a, {})
                    and "digest" in r.get(b, {})]  # fmt: skip
            same = sum(r[a]["digest"] == r[b]["digest"] for r in both)
            if both:
                out.append(f"outputs equal bit for bit, {a} and {b}: "
                           f"{same} of {len(both)} cells")  # fmt: skip
    return out


def brief(row: dict) -> str:
    cell = f"{row['preset']} D{row['D']} G{row['GQA']} {row['B']}x{row['L']}"
    parts = [f"{row['data']} {cell}"]
    for name in ["up", *(k for k in row if isinstance(row.get(k), dict)
                         and k != "up")]:  # fmt: skip
        r = row[name]
        parts.append(f"{name} S{r['splits']} err {r['err']:.2e} "
                     f"bias {r.get('bias', math.nan):+.2f} "
                     f"{r.get('ms', float('nan')):.3f} ms")  # fmt: skip
    if "fa2_ms" in row:
        parts.append(f"fa2 {row['fa2_ms']:.3f} ms, floor {row['floor_ms']:.3f} ms")
    return ", ".join(parts)


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def fitting(preset: str, d: int, cells: list, copies: int = 1) -> tuple[list, int]:
    """The cells whose cache (``copies``: one more a variant converting it)
    fits the free memory less 8 GiB (buffers, the reference's chunks, the
    flush), and the blocks of the largest."""
    slot = h.tq_slot_size(f"turboquant_{preset}", d) * copies
    free = torch.cuda.mem_get_info()[0] - (8 << 30) if tqlib.HAS_CUDA else 1 << 40
    fits = [c for c in cells if c[0] * c[1] * HK * slot <= free]
    blocks = max((b * -(-n // BLOCK) for b, n in fits), default=0)
    return fits, blocks + 1


def run_dim_preset(env, d: int, preset: str, res: dict, t_end: float) -> None:
    """Every data mode, GQA and cell of one (head size, preset) on one cache."""
    cells = list(CELLS)
    sweep = SWEEP if SWEEP and SWEEP[:2] == (preset, d) else None
    copies = 1 + sum(getattr(m, "CONVERTS_CACHE", False) for m in env.grouped.values())
    more = [sweep[3]] if sweep else []
    if env.fa2_ms is not None:  # FA2's K/V first: the caches take what is left
        goal.reserve(env, d, GQAS, cells, DTYPE)
    fits, num_blocks = fitting(preset, d, cells + more, copies)
    for c in cells:
        if c not in fits:
            res["not_run"].append([preset, d, None, *c, "memory"])
    if fits:
        full = f"turboquant_{preset}"
        cache = h.new_tq_kv_cache(num_blocks, BLOCK, HK, d, full, generator=None,
                                  device=tqlib.DEVICE)  # fmt: skip
        for mode in DATA:
            bench.fill_fields(cache.slots, h.tq_config(full, d))
            data.set_values(cache.slots, h.tq_config(full, d), mode[1])
            for gqa in GQAS:
                run_shape(env, Shape(env, preset, d, gqa, cache), mode, res, t_end,
                          fits, num_blocks, sweep)  # fmt: skip
        del cache
    env.fa2_kv = None
    if tqlib.HAS_CUDA:
        torch.cuda.empty_cache()


def run_shape(env, shape: Shape, mode, res, t_end, fits, num_blocks, sweep) -> None:
    """The cells (and the sweep, where it is this shape's) of one shape and
    data mode."""
    key = f"{shape.preset}/D{shape.d}"
    tag = f"{key}/G{shape.gqa}/{':'.join(mode)}"
    if time.time() > t_end:
        res["not_run"] += [[tag, *c, "deadline"] for c in fits]
        return
    t0 = time.time()
    seen = compiled_stage1(env, None)
    if key not in res["dequant_vs_harness"]:
        res["dequant_vs_harness"][key] = dequant_matches_harness(shape)
    for b, n in CELLS:
        if (b, n) not in fits:
            continue
        if time.time() > t_end:
            res["not_run"].append([tag, b, n, "deadline"])
            continue
        row = guarded(res, run_cell, env, shape, num_blocks, b, n, None, mode)
        res["rows"] += [row] if row else []
    if sweep and sweep[2] == shape.gqa and sweep[3] in fits:
        for s in SWEEP_SPLITS:
            if time.time() < t_end:
                row = guarded(res, run_cell, env, shape, num_blocks, *sweep[3], s, mode)
                res["sweep"] += [row] if row else []
    res["shape_s"][tag] = time.time() - t0
    res["compiled"][tag] = compiled_stage1(env, seen)
    write(res, env.out)


def compiled_stage1(env, seen: dict | None) -> dict:
    """Per kernel module, [shared memory bytes, registers, spills] of each
    stage 1 that Triton compiled (from its per-device cache), less the
    first ``seen[name]`` of them; none for a module without that kernel."""
    mods = {"up": (env.up, "_tq_decode_stage1")}
    mods |= {n: (m, "_tq_grouped_decode_stage1") for n, m in env.grouped.items()}
    out = {}
    for name, (module, fn) in mods.items():
        try:
            caches = getattr(module, fn).device_caches.values()
            kernels = [k for c in caches for k in c[0].values()]
        except (AttributeError, IndexError, TypeError):
            continue  # no such kernel (a wrapper, the peer) or another cache layout
        # A kernel that failed to launch (OutOfResources) has no registers.
        stats = [[k.metadata.shared, getattr(k, "n_regs", None),
                  getattr(k, "n_spills", None)] for k in kernels]  # fmt: skip
        out[name] = stats if seen is None else stats[len(seen.get(name, [])) :]
    return out


def guarded(res: dict, fn, *args):
    """``fn(*args)``; an exception (a kernel that cannot launch at this
    shape) is recorded and the run goes on (None)."""
    try:
        return fn(*args)
    except Exception:
        res["errors"].append(traceback.format_exc()[-2000:])
        print(res["errors"][-1], flush=True)
        return None


def write(res: dict, out: Path) -> str:
    (out / "tq_decode_accuracy.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (out / "tq_decode_accuracy.md").write_text(text)
    return text


def table(res: dict) -> str:
    names = res["kernels"]
    head = ("| data | preset | D | GQA | B x L | splits | tokens/split | "
            + " | ".join(f"err {n}" for n in names) + " | bound | "
            + " | ".join(f"bias {n}" for n in names) + " | "
            + " | ".join(f"ms {n}" for n in names) + " |")  # fmt: skip
    lens = "; requests of L / 8 to L" if RAGGED else ""
    title = (f"### TurboQuant decode: relative L2 error against float64 "
             f"({res['device'].get('device')}, Hk {res['Hk']}, {str(DTYPE)[6:]}, block "
             f"{BLOCK}{lens}; within bound (rel L2 and max abs error <= 1.25x up's or "
             f"+2e-4, |bias| = |mean / RMS| of the error <= 0.3): ok / NO)")  # fmt: skip
    lines = [title, "", head, "|" + "---|" * (8 + 3 * len(names))]
    for tag, rows in (("", res["rows"]), ("sweep ", res["sweep"])):
        for r in rows:
            g, runs = r[names[1]], [n for n in names if n in r]
            errs = [f"{r[n]['err']:.2e}" + ("" if n == "up" else (
                " ok" if r[n]["within_bound"] else " NO")) if n in r else "-"
                for n in names]  # fmt: skip
            ms = [f"{r[n]['ms']:.3f}" if "ms" in r.get(n, {}) else "-" for n in names]
            bias = [f"{r[n].get('bias', math.nan):+.2f}" if n in runs else "-"
                    for n in names]  # fmt: skip
            lines.append(
                f"| {r.get('data', 'flat:normal')} | {tag}{r['preset']} | {r['D']} "
                f"| {r['GQA']} | {r['B']} x "
                f"{r['L']} | {g['splits']} | {g['tokens_per_split']} | "
                + " | ".join(errs)
                + f" | {r['bound']:.2e} | "
                + " | ".join(bias)
                + " | "
                + " | ".join(ms)
                + " |"
            )
    bad = [r for r in res["rows"] + res["sweep"] for n in names[1:]
           if n in r and not r[n]["within_bound"]]  # fmt: skip
    failed = sorted({f"{r['preset']} D{r['D']} G{r['GQA']} {n}: {r[n]['error']}"
                     for r in res["rows"] + res["sweep"] for n in names[1:]
                     if "error" in r.get(n, {})})  # fmt: skip
    lines += ["", (f"cells: {len(res['rows'])} + sweep {len(res['sweep'])}; "
              f"(kernel, cell) pairs over the bound: {len(bad)}; not run: "
              f"{len(res['not_run'])}; errors: {len(res['errors'])}"),
              (f"dequant vs tqbatches.dequant (max abs): "
               f"{json.dumps(res['dequant_vs_harness'])}")]  # fmt: skip
    lines += [f"launch failed: {x}" for x in failed]
    lines += same_lines(res["rows"] + res["sweep"], names[1:])
    if res.get("goal"):
        lines += goal.lines(res, res["goal"])
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    t_end = time.time() + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = tqlib.use_tree(args.tree)
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    env.gd, env.out, env.hk, env.fa2_ms = gd, out, HK, None
    env.up, env.grouped, files = kernels(args, gd)
    env.flush = torch.empty(bench.FLUSH_BYTES if tqlib.HAS_CUDA else 1 << 20,
                            dtype=torch.uint8, device=tqlib.DEVICE)  # fmt: skip
    if args.fa2:
        goal.setup(env)
    res = {
        "device": tqlib.device_info(), "tree": str(env.tree), "files": files,
        "kernels": ["up", *env.grouped], "Hk": HK, "block": BLOCK,
        "max_num_seqs": MAX_NUM_SEQS, "rows_checked": ROWS, "reps": REPS,
        "argv": sys.argv[1:], "rows": [], "sweep": [], "not_run": [],
        "errors": [], "shape_s": {}, "dequant_vs_harness": {}, "compiled": {},
        "goal": args.goal if args.fa2 else None,
        "ceilings": getattr(env, "ceil", None),
    }  # fmt: skip
    for d in DIMS:
        for preset in PRESETS:
            guarded(res, run_dim_preset, env, d, preset, res, t_end)
    text = write(res, out)
    print(text)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
