#!/usr/bin/env python3
"""Benchmark: apply.py applying a 5-patch stack to a warm local base, against
plain `git am` of the same files (tests excluded).

The base is the real v0.20.2 tree in the tool's cache (built from the release
wheel on first use). The stack is five small patches to five different files,
made here. Both sides run REPS times; the median wall time of each is printed
with the ratio, and the figures are written as JSON.

    .venv/bin/python ci/bench_apply.py [--reps 15] [--json build/bench_apply.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPLY = ROOT / "apply.py"
FILES = [
    "vllm/v1/attention/backends/turboquant_attn.py",
    "vllm/v1/worker/workspace.py",
    "vllm/engine/arg_utils.py",
    "vllm/config/cache.py",
    "vllm/v1/attention/ops/triton_turboquant_decode.py",
]
ENV = dict(os.environ, GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="b@example.com",
           GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="b@example.com",
           GIT_AUTHOR_DATE="2026-01-01T00:00:00+00:00",
           GIT_COMMITTER_DATE="2026-01-01T00:00:00+00:00")


def sh(*cmd: str, cwd: Path | None = None) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p.stdout.strip()


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"{' '.join(cmd)}: {p.stdout}{p.stderr}")
    return dt


def bench_series(tmp: Path) -> tuple[Path, Path, str, str, list[str]]:
    """A series of five one-line patches on the v0.20.2 base: the project,
    the scratch clone, the base (rev, commit) and the patch files."""
    proj = tmp / "proj"
    (proj / "patches" / "bench").mkdir(parents=True)
    (proj / "series").write_text("#@ stack bench tag=v0.20.2\n")
    line = sh(sys.executable, str(APPLY), "base", "--series", str(proj / "series"))
    rev, commit, repo = line.split()[:3]
    work = tmp / "work"
    sh("git", "clone", "-q", "--no-checkout", repo.split("=", 1)[1], str(work))
    sh("git", "checkout", "-q", "--detach", commit, cwd=work)
    names = []
    for i, f in enumerate(FILES, 1):
        path = work / f
        path.write_text(path.read_text() + f"\n# bench patch {i}\n")
        sh("git", "commit", "-q", "-am",
           f"[Bench] Patch {i}\n\nBench.\n\nBug: https://example.com/{i}\n"
           "Upstream-Status: Inappropriate [benchmark]\nTests: tests/x.py\n"
           "Signed-off-by: bench <b@example.com>", cwd=work)
        name = f"bench/{i:04d}-patch-{i}.patch"
        sh(sys.executable, str(APPLY), "format-patch", "--repo", str(work), "HEAD",
           "--out", str(proj / "patches" / name))
        names.append(name)
    (proj / "series").write_text("#@ stack bench tag=v0.20.2\n" +
                                 "".join(n + "\n" for n in names))
    return proj, work, rev, commit, [str(proj / "patches" / n) for n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=str(ROOT / "build" / "bench_apply.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-apply-"))
    proj, work, rev, commit, files = bench_series(tmp)
    # A user's Python caches the tool's bytecode; an environment with
    # PYTHONDONTWRITEBYTECODE would recompile it on every run (about 40 ms
    # more), so the warm-up run below may write the cache.
    env = dict(ENV, VLLM_PATCHES_OFFLINE="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    tool_cmd = [sys.executable, str(APPLY), "--series", str(proj / "series"),
                "--no-tests"]
    am_cmd = ["git", "-c", "core.hooksPath=/dev/null", "am", "-q", "-k",
              "--no-3way", *files]
    reset_cmd = ["git", "checkout", "-q", "-f", "--detach", commit]
    timed(tool_cmd, tmp, env)  # warm: worktree and bytecode cache exist
    runs: dict[str, list[float]] = {k: [] for k in ("tool", "am", "reset_am")}
    for _ in range(args.reps):
        runs["tool"].append(timed(tool_cmd, tmp, env))
        sh(*reset_cmd, cwd=work)
        runs["am"].append(timed(am_cmd, work, env))
        t0 = time.perf_counter()
        sh(*reset_cmd, cwd=work)
        runs["reset_am"].append(time.perf_counter() - t0 + timed(am_cmd, work, env))
    report(runs, args, f"{rev} {commit}", len(files))


def report(runs: dict[str, list[float]], args: argparse.Namespace, base: str,
           n: int) -> None:
    """The medians printed as a table, and everything in --json."""
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"reps": args.reps, "patches": n, "base": base,
           "median_s": {k: round(v, 4) for k, v in med.items()},
           "ratio_vs_git_am": round(med["tool"] / med["am"], 3),
           "ratio_vs_checkout_and_git_am": round(med["tool"] / med["reset_am"], 3),
           "all_s": {k: [round(x, 4) for x in v] for k, v in runs.items()}}
    rows = [("apply.py --no-tests (5 patches, warm)", med["tool"]),
            ("git am (same 5 files, checked-out base)", med["am"]),
            ("git checkout -f base && git am", med["reset_am"])]
    print(f"{'what':<44} {'median s':>9}")
    for name, v in rows:
        print(f"{name:<44} {v:9.3f}")
    print(f"{'ratio apply.py / git am':<44} {med['tool'] / med['am']:9.2f}")
    print(f"{'ratio apply.py / (checkout + git am)':<44} "
          f"{med['tool'] / med['reset_am']:9.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
