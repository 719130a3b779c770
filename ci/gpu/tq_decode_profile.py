"""One decode step of the grouped TurboQuant decode for ncu (issue 28): the
bench's preset, cache and metadata (tq_decode_bench.py), the grouped
launcher called --calls times eagerly (the first compiles; ncu's -s 1 skips
it), nothing else on the GPU between. With --peer DIR --kernel peer or
peer_mma: vllm#53060's decode instead (its own dispatch, or its tensor-core
path), on the same cache bytes in its layout (tqpeer.py).

    ncu -k regex:_tq_grouped_decode_stage1 -s 1 -c 1 --set full \
        python ci/gpu/tq_decode_profile.py --tree T --preset P --cell 32x32768
    ncu -k regex:decode_kernel -s 1 -c 1 --set full python ci/gpu/tq_decode_profile.py \
        --tree T --cell 32x32768 --peer .peer --kernel peer_mma
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tq_decode_bench as bench
import tqlib
import tqpeer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--cell", default="32x32768", help="BxL")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--peer", help="vllm#53060's staged sources (peer_stage.sh)")
    ap.add_argument("--kernel", default="new", choices=("new", "peer", "peer_mma"))
    args = ap.parse_args()
    batch, length = bench.parse_cell(args.cell)
    env = tqlib.use_tree(args.tree)
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    env.gd = gd
    p = bench.Preset(env, args.preset, [(batch, length)])
    cell = p.metadata(batch, length)
    if args.kernel == "new":
        call = bench.launchers(env, p, cell, batch)["new"]
    else:  # the peer's build first, so ncu's -s 1 skips only its warm-up call
        peer = tqpeer.build(args.peer)
        q = cell["query"].view(batch, bench.HQ, bench.D)
        fns, _ = tqpeer.calls(
            peer, tqpeer.to_peer_layout(p.slots, p.cfg), p.layer, q,
            cell["table"], cell["seq_lens"], length, bench.BLOCK,
        )  # fmt: skip
        call = fns[args.kernel]
    for _ in range(args.calls):
        call()
    tqlib.sync()
    print(f"{args.kernel} {args.preset} {args.cell}: {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
