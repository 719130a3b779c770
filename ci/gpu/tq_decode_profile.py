"""One decode step of the grouped TurboQuant decode for ncu (issue 28): the
bench's preset, cache and metadata (tq_decode_bench.py), the grouped
launcher called --calls times eagerly (the first compiles; ncu's -s 1 skips
it), nothing else on the GPU between.

    ncu -k regex:_tq_grouped_decode_stage1 -s 1 -c 1 --set full \
        python ci/gpu/tq_decode_profile.py --tree T --preset P --cell 32x32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tq_decode_bench as bench  # noqa: E402
import tqlib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--cell", default="32x32768", help="BxL")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    batch, length = bench.parse_cell(args.cell)
    env = tqlib.use_tree(args.tree)
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    env.gd = gd
    p = bench.Preset(env, args.preset, [(batch, length)])
    new = bench.launchers(env, p, p.metadata(batch, length), batch)["new"]
    for _ in range(args.calls):
        new()
    tqlib.sync()
    print(f"{args.preset} {args.cell}: {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
