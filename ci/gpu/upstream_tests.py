"""vLLM's own tests of what a stack changes, on the GPU: `apply.py upstream`'s
comparison (applylib.upstreamsuite.compare_trees) over the rig's unpacked
base and patched trees, with the release's tests/ carried in a tarball.

    python3 ci/gpu/upstream_tests.py --stack tq-v0.33 --tests-tgz T.tgz \\
        --base /tmp/trees/tq33-base --patched /tmp/trees/tq33-patched

Prints the report (the test files, base and patched outcome counts, each
regression) and exits 1 on a regression, as the command does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from applylib.series import load_patch, parse_series
from applylib.upstreamsuite import compare_trees


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", required=True)
    ap.add_argument("--tests-tgz", required=True, type=Path, help="tests/ tarball")
    ap.add_argument("--base", required=True, type=Path, help="the base tree")
    ap.add_argument("--patched", required=True, type=Path, help="the patched tree")
    args = ap.parse_args()
    series = parse_series(ROOT / "series")
    stack = next(s for s in series.stacks if s.name == args.stack)
    patches = [load_patch(series, e) for e in stack.patches]
    for tree in (args.base, args.patched):  # vLLM's tests/ from the tarball
        shutil.rmtree(tree / "tests", ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(args.tests_tgz) as tar:
            tar.extractall(tmp, filter="data")
        host = "GPU" if torch.cuda.is_available() else "CPU"
        print(f"{stack.name}: vLLM's tests of the modules its patches change ({host})")
        return compare_trees(
            ROOT,
            stack,
            patches,
            (args.base, args.patched),
            Path(tmp) / "tests",
            sys.executable,
        )


if __name__ == "__main__":
    sys.exit(main())
