"""The grouped decode at a shape the dispatch refuses (issue 51 item 6): 64
query heads a KV head at D 64, where 0009's kernel faulted on an H100
("an illegal memory access"). Run under compute-sanitizer, it names the
kernel and the access; the gate (``grouped_decode_supported``) is lifted
in this process only.

    compute-sanitizer --tool memcheck python ci/gpu/tq_group64_probe.py \\
        --tree T [--preset 4bit_nc] [--head 64] [--group 64] [--tokens 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tq_decode_accuracy as acc
import tq_decode_bench as bench
import tqlib
from tqlib import h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", required=True)
    ap.add_argument("--preset", default="4bit_nc")
    ap.add_argument("--head", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    env = tqlib.use_tree(a.tree)
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    gd.grouped_decode_supported = lambda *args: True  # the refused shape
    acc.CELLS, batch = ((2, a.tokens),), 2
    full = f"turboquant_{a.preset}"
    blocks = batch * -(-a.tokens // acc.BLOCK) + 1
    cache = h.new_tq_kv_cache(blocks, acc.BLOCK, acc.HK, a.head, full,
                              generator=None, device=tqlib.DEVICE)  # fmt: skip
    bench.fill_fields(cache.slots, h.tq_config(full, a.head))
    shape = acc.Shape(env, a.preset, a.head, a.group, cache)
    cell = acc.Cell(shape, blocks, batch, a.tokens)
    out = gd.triton_turboquant_grouped_decode_attention(
        num_kv_splits=1, **cell.buffers(1), **cell.args
    )
    tqlib.sync()
    got = out[cell.rows].double()
    print(f"{a.preset} D{a.head} group {a.group}: ran, error "
          f"{float((got - cell.ref).norm() / cell.ref.norm()):.3g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
