"""The patches' own tests for vLLM (tests/upstream/<stack>/<patch>/), each
run alone under plain pytest in the trees named for it: what `apply.py
upstream` does for base and patched, on trees cut at other patches too.

    python3 ci/gpu/kept_tests.py --trees /tmp/trees 0003=base,patched \
        0010=base,upto9,patched

Each TREE is a folder of --trees holding a vLLM source tree with vLLM's
tests/; prints each run's outcome lines and E lines."""

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from applylib.upstreamtest import HOST_PLUGIN, run_plain

KEEP = ("E  ", "PASSED", "FAILED", "ERROR", "SKIPPED")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="tq-v0.33")
    ap.add_argument("--trees", type=Path, required=True)
    ap.add_argument("plan", nargs="+", help="PATCH=TREE[,TREE...]")
    args = ap.parse_args()
    kept = {p.name[:4]: p for p in (ROOT / "tests/upstream" / args.stack).iterdir()}
    for item in args.plan:
        patch, trees = item.split("=")
        folder = kept[patch]
        files = sorted(folder.rglob("*.py"))
        for name in trees.split(","):
            tree = args.trees / name
            rels = [str(f.relative_to(folder)) for f in files]
            for f, rel in zip(files, rels):
                shutil.copy(f, tree / rel)
            t0 = time.time()
            p = run_plain(tree, rels, sys.executable, HOST_PLUGIN)
            took = time.time() - t0
            print(f"===== {patch} in {name}: rc {p.returncode}, {took:.0f} s")
            tail = p.stdout.splitlines()[-1:] if p.stdout else []
            for line in [x for x in p.stdout.splitlines() if x.startswith(KEEP)] + tail:
                print(line[:400])
            if p.returncode not in (0, 1):
                print(p.stdout[-3000:], p.stderr[-2000:])
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
