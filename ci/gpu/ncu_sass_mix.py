"""The instruction mix of a kernel from ncu's source page (issue 28):
`ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv`,
then `python ci/gpu/ncu_sass_mix.py R.csv`. Prints each SASS opcode's share
of the executed warp instructions and of the warp-stall samples, and the
loop's register moves (IMAD.MOV / MOV) per tensor-core MMA (HMMA)."""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0] if words else "?"


def main(path: str) -> int:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(r for r in rows if "Source" in r and "Address" in r)
    col = {h: i for i, h in enumerate(head)}
    data = [r for r in rows if len(r) == len(head) and r is not head]
    execs = [num(r[col["Instructions Executed"]]) for r in data]
    stalls = [num(r[col["Warp Stall Sampling (All Samples)"]]) for r in data]
    ops = [opcode(r[col["Source"]]) for r in data]
    by_n, by_s = collections.Counter(), collections.Counter()
    for op, n, s in zip(ops, execs, stalls):
        by_n[op.split(".")[0]] += n
        by_s[op.split(".")[0]] += s
    total_n, total_s = sum(execs) or 1, sum(stalls) or 1
    print(f"{path}: {total_n:.4g} warp instructions, {total_s:.4g} stall samples")
    print("opcode      instr%  stall%")
    for op, n in by_n.most_common(20):
        print(f"{op:10s} {100 * n / total_n:6.1f} {100 * by_s[op] / total_s:6.1f}")
    top = max(execs)
    loop = [op for op, n in zip(ops, execs) if n >= top / 2]
    moves = sum(op.startswith(("IMAD.MOV", "MOV")) for op in loop)
    mmas = sum(op.startswith("HMMA") for op in loop) or 1
    print(f"loop: {len(loop)} instructions, {moves / mmas:.1f} moves per HMMA")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu's source page as CSV")
    sys.exit(main(ap.parse_args().csv))
