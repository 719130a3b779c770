"""UltraQuant's prefill loop in a real full CUDA graph (tq-v0.33/0004): the
graph captured on the metadata ``build_for_cudagraph_capture`` makes from the
runner's dummy values, then replayed with the device buffers refilled with
real spec-decode verification batches, against an eager step of the same
batch and float64 attention over the FP4 + UE8M0 bytes the cache holds.

One attention step (cache store + ``forward``) per batch, through
``tests/patches/tqbatches.py`` (the tests' harness: config, impl, builder,
cache layout, metadata as the runner makes them; UltraQuant's Triton
kernels compiled for the device, no FlyDSL). Without CUDA (a check of this
script here) the "replay" reruns the step eagerly on the capture's metadata,
as the CPU tests do.

Per batch it records: whether capture worked (the exception otherwise),
whether the replay equals the eager step bit for bit (contexts below 1024,
where eager picks the kernel's 2D launch as the capture did), and each
one's largest error against the reference. v0.33.0 is expected to replay
the capture's branch (its cached context ignored), v0.33.0 + 0001-0003 the
capture's lengths, the patched tree the real ones.

    python ci/gpu/uq_cudagraph.py --tree T --label patched --out uqcg.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "patches"))
import torch  # noqa: E402
import tqharness as h  # noqa: E402

if not torch.cuda.is_available():  # vLLM's Triton kernels in the interpreter
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAPE = dict(hq=16, hk=2, head=128, block=64, max_model_len=4096)
BATCHES = {
    # name: (rows (cached, q), padding rows)
    "verify-k3": ([(300, 4), (700, 4), (950, 4)], 1),
    "verify-k1": ([(90, 2), (513, 2)], 2),
    "decode": ([(200, 1), (600, 1), (1000, 1)], 0),
    "verify-long": ([(1500, 4), (3000, 4)], 0),  # eager takes the split-KV launch
}
# --small (a CPU check of this script): the tests' shape, short contexts.
SMALL_BATCHES = {
    "verify-k3": ([(70, 4), (150, 4)], 1),
    "decode": ([(40, 1), (90, 1)], 0),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--small", action="store_true", help="tests' shape, short rows")
    return p.parse_args()


def step_graph(tb, impl, layer, real, captured, bufs):
    """Capture a step on the capture metadata, refill, replay: the output
    (a real CUDA graph where CUDA is there, an eager rerun otherwise)."""
    tb.run_step(impl, layer, real, captured)  # warm-up: Triton compiles
    if not torch.cuda.is_available():
        tb.refill(bufs, real)
        return tb.run_step(impl, layer, real, captured)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.run_step(impl, layer, real, captured)
    tb.refill(bufs, real)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def run_batch(tb, env, name: str, rows, pad: int) -> dict:
    impl, layer = tb.new_impl(env, "as-is")
    reqs = [tb.Req(c, q) for c, q in rows]
    real = tb.make_batch(
        env, impl, layer, reqs, seed=len(name), pad_tokens=pad * reqs[0].q,
        pad_reqs=pad, store_context=False,
    )  # fmt: skip
    builder = env.builder()
    captured, bufs = tb.capture_metadata(builder, real)
    res: dict = {"batch": name, "rows": rows, "pad": pad}
    try:
        replayed = step_graph(tb, impl, layer, real, captured, bufs)
        res["captured"] = True
    except Exception as e:  # noqa: BLE001
        res.update(captured=False, error=f"{type(e).__name__}: {e}"[:300])
        traceback.print_exc()
        return res
    eager = tb.run_step(impl, layer, real, builder.build(0, real.cam))
    want = tb.reference(real, impl, layer)
    err = lambda out: max(  # noqa: E731
        (g - w).abs().max().item() for g, w in zip(tb.rows(out, reqs), want)
    )
    res.update(
        replay_equals_eager=bool(torch.equal(replayed, eager)),
        replay_max_err=err(replayed),
        eager_max_err=err(eager),
        tolerance=tb.tolerance(impl),
    )
    return res


def main() -> int:
    args = parse_args()
    h.use_tree_env(args.tree)
    import pytest
    import tqbatches as tb

    shape = tb.Shape(preset=h.UQ_PRESET, dtype=torch.bfloat16, **SHAPE)
    batches = BATCHES
    if args.small:
        shape, batches = tb.UQ_SHAPE, SMALL_BATCHES
    results = []
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        env = tb.open_ultraquant(args.tree, Path(d), mp.setattr, shape)
        for name, (rows, pad) in batches.items():
            results.append(run_batch(tb, env, name, rows, pad))
            print(json.dumps(results[-1]), flush=True)
        tb.close_backend()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"label": args.label, "tree": str(args.tree), "device": device}
    args.out.write_text(json.dumps({**report, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
