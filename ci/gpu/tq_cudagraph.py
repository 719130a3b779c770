"""TurboQuant attention under CUDA-graph capture and sync debugging, for one
vLLM tree per process (issue 4 / tq/0002; vllm issue 40807).

For each scenario (one attention step = the chunk's cache store + forward(),
as the model runner runs them):

  continuation  one request, q_len 512 over 4096 cached tokens (the dequant +
                attention path, q_len > 128)
  spec_decode   8 requests of q_len 4 (1 + 3 MTP drafts) over 500..4000
                cached tokens (q_len > 1: TurboQuant's prefill loop, small
                continuation branch: the decode kernel)
  mixed         3 decodes first, then a continuation of 512 over 4096 and
                one of 64 over 1000 (forward()'s mixed decode + prefill split)

it records: the number of synchronizing CUDA calls in one step
(``torch.cuda.set_sync_debug_mode("warn")``) and whether the step passes
under ``"error"``; whether the step can be captured in ``torch.cuda.graph``
(the exception otherwise); and, captured, whether replaying the graph on new
inputs of the same shape (new q/k/v, new cached context, and for
spec_decode new context lengths) equals an eager step on them.

Then it times a prefill step for two batches of 8 continuation requests
(q_len 512 and q_len 64, each over 4096 cached tokens): wall clock per step
over 20 back-to-back steps (the host waits at every sync, so its launch work
no longer overlaps the GPU), the GPU time of one step (CUDA events), and,
where capture works, one graph replay per step.

Modes (tqlib.set_attention_mode): ``sdpa`` (the tree as it runs on the
device, no vLLM flash-attn) and ``fa`` (its flash-attn path on PyTorch's FA2).

    python ci/gpu/tq_cudagraph.py --tree T --label patched --out cg.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import tqlib  # noqa: E402

HQ, HK, D, BLOCK = 16, 4, 256, 16
DTYPE = torch.bfloat16
PRESET = "turboquant_4bit_nc"
MNBT = 8192
SCENARIOS = {
    # (cached, q_len) per request, decodes first
    "continuation": [(4096, 512)],
    "spec_decode": [
        (517, 4),
        (1033, 4),
        (2048, 4),
        (4000, 4),
        (3001, 4),
        (1500, 4),
        (777, 4),
        (2600, 4),
    ],
    "mixed": [(1000, 1), (2000, 1), (3000, 1), (4096, 512), (1000, 64)],
}
TIMING = {
    "batch8_q512": [(4096, 512)] * 8,
    "batch8_q64": [(4096, 64)] * 8,
}


class Step:
    """Static inputs of one attention step over a Paged cache."""

    def __init__(self, env, impl, layer, builder, reqs, capacity, seed):
        self.env, self.impl, self.layer, self.builder = env, impl, layer, builder
        self.reqs = list(reqs)
        self.paged = tqlib.Paged(impl, layer, PRESET, HK, D, BLOCK, capacity, seed)
        self.gen = torch.Generator(device=tqlib.DEVICE).manual_seed(seed + 1)
        n = sum(q for _, q in reqs)
        self.query = torch.empty(n, HQ * D, dtype=DTYPE, device=tqlib.DEVICE)
        self.key = torch.empty(n, HK * D, dtype=DTYPE, device=tqlib.DEVICE)
        self.value = torch.empty_like(self.key)
        self.output = torch.empty(n, HQ * D, dtype=DTYPE, device=tqlib.DEVICE)
        self.meta = None
        self.set_inputs(self.reqs)

    def set_inputs(self, reqs) -> None:
        """Fresh random context (stored) and chunk q/k/v for ``reqs``; the
        metadata of the step (device tensors updated in place once built)."""
        self.reqs = list(reqs)
        g = self.gen
        for i, (c, _) in enumerate(reqs):
            if c:
                k = tqlib.rand((c, HK, D), DTYPE, g)
                v = tqlib.rand((c, HK, D), DTYPE, g)
                self.paged.store(i, 0, k, v)
        self.query.copy_(tqlib.rand(self.query.shape, DTYPE, g))
        self.key.copy_(tqlib.rand(self.key.shape, DTYPE, g))
        self.value.copy_(tqlib.rand(self.value.shape, DTYPE, g))
        rows = list(range(len(reqs)))
        cam = tqlib.make_cam(
            self.paged, rows, [c for c, _ in reqs], [q for _, q in reqs]
        )
        meta = self.builder.build(0, cam)
        if self.meta is None:
            self.meta = meta
        else:  # a replay reads the captured device tensors: refill them
            for name in ("seq_lens", "slot_mapping", "block_table", "query_start_loc"):
                getattr(self.meta, name).copy_(getattr(meta, name))
        self.eager_meta = meta

    def run(self, meta=None) -> torch.Tensor:
        meta = meta or self.meta
        n = self.query.shape[0]
        self.impl.do_kv_cache_update(
            self.layer, self.key, self.value, self.paged.kv_cache, meta.slot_mapping[:n]
        )
        self.impl.forward(
            self.layer, self.query, self.key, self.value, self.paged.kv_cache, meta,
            output=self.output,
        )  # fmt: skip
        return self.output


def count_syncs(fn) -> dict:
    res: dict = {}
    if not tqlib.HAS_CUDA:
        return {"note": "no CUDA"}
    tqlib.sync()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Count the syncs themselves, not the one-time "prototype feature" notice.
    msgs = [
        str(x.message).splitlines()[0][:160]
        for x in w
        if "called a synchronizing" in str(x.message)
    ]
    res["syncs_per_step"] = len(msgs)
    res["sync_messages"] = sorted(set(msgs))[:5]
    tqlib.sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        res["error_mode"] = "ok"
    except Exception as e:
        res["error_mode"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tqlib.sync()
    return res


def healthy() -> bool:
    try:
        x = torch.ones(4, device=tqlib.DEVICE)
        ok = float((x * 2).sum()) == 8.0
        tqlib.sync()
        return ok
    except Exception:
        return False


def capture(step: Step) -> tuple[dict, torch.cuda.CUDAGraph | None]:
    res: dict = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.run()
    torch.cuda.current_stream().wait_stream(side)
    tqlib.sync()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step.run()
        tqlib.sync()
        res["capture"] = "ok"
        return res, graph
    except Exception as e:
        res["capture"] = "failed"
        res["capture_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        res["healthy_after"] = healthy()
        return res, None


def replay_vs_eager(step: Step, graph, new_reqs, rounds: int = 2) -> dict:
    out = []
    for r in range(rounds):
        step.set_inputs(new_reqs[r % len(new_reqs)])
        tqlib.sync()
        graph.replay()
        tqlib.sync()
        got = step.output.clone()
        eager = step.run(step.eager_meta).clone()
        out.append({
            "reqs": step.reqs,
            "max_abs_diff": float((got.float() - eager.float()).abs().max()),
            "bit_exact": bool(torch.equal(got, eager)),
            "finite": bool(torch.isfinite(got).all()),
        })  # fmt: skip
    return {
        "replays": out,
        "ok": all(o["finite"] and o["max_abs_diff"] <= 1e-2 for o in out),
    }


def wall_per_step(fn, steps: int = 20, loops: int = 5) -> float:
    fn()
    tqlib.sync()
    per = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        tqlib.sync()
        per.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(per)


def parse_args() -> argparse.Namespace:
    global HQ, HK, D, SCENARIOS, TIMING, MNBT
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="sdpa,fa")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--samples", default="")
    ap.add_argument("--small", action="store_true", help="CPU sanity shapes")
    args = ap.parse_args()
    if args.small:
        HQ, HK, D, MNBT = 4, 1, 64, 256
        SCENARIOS = {
            "continuation": [(300, 130)],
            "spec_decode": [(50, 4), (70, 4)],
            "mixed": [(40, 1), (300, 130), (60, 8)],
        }
        TIMING = {"batch2_q130": [(300, 130)] * 2}
    return args


def build(env) -> tuple:
    """As the model runner: workspace manager, impl, builder, lock."""
    ws = env.workspace
    ws.reset_workspace_manager()
    ws.init_workspace_manager(tqlib.DEVICE)
    cfg = tqlib.make_config(
        env, hq=HQ, hk=HK, d=D, preset=PRESET, block_size=BLOCK,
        max_num_batched_tokens=MNBT, max_model_len=131072,
    )  # fmt: skip
    impl = tqlib.make_impl(env, cfg, PRESET, HQ, HK, D)
    layer = tqlib.make_layer(env, impl, D)
    builder = tqlib.make_builder(env, cfg, HQ, HK, D)
    ws.lock_workspace()
    return impl, layer, builder


class Run:
    """One tree's scenarios and timings, mode by mode; a failed capture that
    leaves the CUDA context unusable stops what follows."""

    def __init__(self, args, env, parts) -> None:
        self.args, self.env, self.parts = args, env, parts
        self.samples: dict = {}
        self.poisoned = False

    def guarded(self, what: str, row: dict, fn, hidden=("trace",)) -> None:
        """``fn(row)``, its exception recorded in the row, the row printed."""
        try:
            fn(row)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            row["trace"] = traceback.format_exc()[-1500:]
        shown = {k: v for k, v in row.items() if k not in hidden}
        print(f"[{self.args.label}] {what}: " + json.dumps(shown)[:600], flush=True)

    def capture(self, step: Step, row: dict):
        cap, graph = capture(step)
        if graph is None and not cap.get("healthy_after", True):
            self.poisoned = True
        return cap, graph

    def scenario(self, key: str, reqs, row: dict) -> None:
        # New inputs for the replays: same q_lens; for requests served
        # by the decode kernel (q_len <= 128) also new context lengths.
        new = [
            [(c if q > 128 or q == 1 else c + 37 * (j + 1) * (r + 1), q)
             for j, (c, q) in enumerate(reqs)]
            for r in range(2)
        ]  # fmt: skip
        capacity = [
            max(c for c, _ in (x[j] for x in [reqs, *new])) + q
            for j, (_, q) in enumerate(reqs)
        ]
        step = Step(self.env, *self.parts, reqs, capacity, seed=11)
        out = step.run()
        tqlib.sync()
        self.samples[key] = out.float().cpu()
        row["finite"] = bool(torch.isfinite(out).all())
        row["sync"] = count_syncs(step.run)
        if tqlib.HAS_CUDA:
            cap, graph = self.capture(step, row)
            row.update(cap)
            if graph is not None:
                row["replay"] = replay_vs_eager(step, graph, new)

    def timing(self, reqs, row: dict) -> None:
        step = Step(self.env, *self.parts, reqs, [c + q for c, q in reqs], seed=21)
        steps, loops, reps = (1, 1, 1) if self.args.small else (20, 5, 5)
        row["eager_wall_ms_per_step"] = wall_per_step(step.run, steps, loops)
        row["eager_gpu_ms_per_step"] = tqlib.time_calls(step.run, 0.5, reps, 30)[
            "median_ms"
        ]
        row["sync"] = count_syncs(step.run)
        if tqlib.HAS_CUDA:
            cap, graph = self.capture(step, row)
            row["capture"] = cap["capture"]
            if graph is not None:
                row["graph_wall_ms_per_step"] = wall_per_step(graph.replay)
                row["graph_gpu_ms_per_step"] = tqlib.time_calls(
                    graph.replay, 0.5, 5, 30
                )["median_ms"]

    def mode(self, mode: str, res: dict) -> None:
        tqlib.set_attention_mode(self.env, mode)
        for name in self.args.scenarios.split(","):
            key, reqs = f"{mode}/{name}", SCENARIOS[name]
            row: dict = {"reqs": reqs}
            res["scenarios"][key] = row
            print(f"[{self.args.label}] {key} ...", flush=True)
            if self.poisoned:
                row["skipped"] = "CUDA context unusable after an earlier failed capture"
                continue
            self.guarded(
                key, row, lambda r: self.scenario(key, reqs, r), ("trace", "reqs")
            )
        if self.args.no_timing or self.poisoned:
            return
        for name, reqs in TIMING.items():
            key = f"{mode}/{name}"
            row = {"reqs": len(reqs), "q_len": reqs[0][1], "cached": reqs[0][0]}
            res["timing"][key] = row
            self.guarded(f"timing {key}", row, lambda r: self.timing(reqs, r))


def main() -> int:
    args = parse_args()
    env = tqlib.use_tree(args.tree)
    res: dict = {
        "label": args.label,
        "tree": str(env.tree),
        "device": tqlib.device_info(),
        "tree_has_flash_attn": env.has_flash_attn,
        "scenarios": {},
        "timing": {},
    }
    run = Run(args, env, build(env))
    for mode in args.modes.split(","):
        run.mode(mode, res)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    if args.samples:
        torch.save(run.samples, args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
