"""CI's last lines: what ran where. The patch tests (tests/patches/) need a
vLLM tree, so the main job runs them on each stack's base and patched tree
(build/report.json) and the mutants run re-runs them on each wrong fix
(build/mutants.json); ci/docs_check.py checks the docs (build/docs_check.txt);
the final pytest run holds the tool's own tests."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from applylib.series import short_name


def load(path: Path, key: str) -> list[dict] | None:
    try:
        return json.loads(path.read_text())[key]
    except (OSError, ValueError, KeyError):
        return None


def counts(c: Counter) -> str:
    return ", ".join(f"{k}: {n}" for k, n in c.most_common())


def main(build: Path) -> int:
    stacks = load(build / "report.json", "stacks")
    if stacks is None:
        print("ci: main job: no build/report.json (it did not finish)")
    else:
        patches = [p for s in stacks for p in s["patches"]]
        regression = Counter(
            "{base} on the base, {patched} patched".format(**p["regression"])
            for p in patches
            if p.get("regression")
        )
        tests = Counter(p.get("tests") for p in patches)
        print(
            f"ci: main job: {len(patches)} patches in {len(stacks)} stacks, "
            "each one's tests run on its base and patched tree: regression "
            f"tests {counts(regression)}; all its tests {counts(tests)} "
            "(build/report.txt)"
        )
    mutants = load(build / "mutants.json", "mutants")
    if mutants is None:
        print("ci: mutants: no build/mutants.json (the run did not finish)")
    else:
        outcomes = Counter(m.get("outcome") for m in mutants)
        print(f"ci: mutants: {len(mutants)} wrong fixes: {counts(outcomes)}")
    docs = build / "docs_check.txt"
    lines = docs.read_text().splitlines() if docs.is_file() else []
    if not lines:
        print("ci: docs check: no build/docs_check.txt (it did not run)")
    elif lines[-1].startswith("docs check: "):
        print(f"ci: {lines[-1]}")
    else:
        print(f"ci: docs check: {len(lines)} problem(s) (build/docs_check.txt)")
    print("ci: the pytest run above: the tool's own tests (tests/tool)")
    for line in stage_table(build, stacks, mutants):
        print(f"ci: {line}")
    return 0


def stage_table(
    build: Path, stacks: list[dict] | None, mutants: list[dict] | None
) -> list[str]:
    """Wall time per stage (build/stages.tsv, written by ci/test.sh), the
    main job per stack (its set-up and its runs' seconds: the stacks' runs
    share the lanes, so they add up to more than the stage), per tree
    position and its slowest node ids, the mutants per patch."""
    try:
        stages = [
            ln.split("\t") for ln in (build / "stages.tsv").read_text().split("\n")
        ]
    except OSError:
        return ["stage times: no build/stages.tsv"]
    rows = [("stage", "secs")]
    for name, secs in (s for s in stages if len(s) == 2):
        rows.append((name, secs))
        if name == "main job":
            for st in stacks or []:
                rows.append(
                    (f"  stack {st['name']} (lane-s)", f"{st.get('seconds', 0):.0f}")
                )
                for j, w in st.get("position_seconds", {}).items():
                    rows.append((f"    position {j} (pytest run)", f"{w:.0f}"))
                rows += slowest(st)
        if name == "mutants":
            per: Counter = Counter()
            n: Counter = Counter()
            for m in mutants or []:
                per[m["patch"]] += m.get("seconds", 0)
                n[m["patch"]] += 1
            for patch, secs_ in per.items():
                rows.append((f"  {short_name(patch)} ({n[patch]})", f"{secs_:.0f}"))
    total = sum(int(s[1]) for s in stages if len(s) == 2)
    rows.append(("total", str(total)))
    width = max(len(r[0]) for r in rows)
    return [f"{a.ljust(width)}  {b.rjust(6)}" for a, b in rows]


def slowest(stack: dict, n: int = 5) -> list[tuple[str, str]]:
    """The stack's `n` slowest node ids: where its positions' time went."""
    runs = [
        (o.get("seconds", 0), f"{short_name(p['file'])} {kind}", node)
        for p in stack.get("patches", [])
        for kind, outs in p.get("test_outcomes", {}).items()
        for node, o in outs.items()
    ]
    return [
        (
            f"      {node.split('/')[-1].removeprefix('test_')[:44]} ({who})",
            f"{secs:.0f}",
        )
        for secs, who, node in sorted(runs, reverse=True)[:n]
    ]


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build")))
