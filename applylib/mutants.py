"""apply.py mutants: every patch's tests must catch wrong fixes.

A mutant is a small diff against the tree a patch makes (the base plus the
patches up to it): the bug put back another way, or a plausible wrong fix.
They live in tests/mutants/<stack>/<patch file stem>/<name>.diff:

    Mutant: one line saying what it breaks
    Tests: <node ids> (optional: the tests that should catch it; default:
           all of the patch's Tests)

    diff --git a/vllm/... b/vllm/...
    ...

Each mutant is applied to the patch's tree and the tests run. A mutant is
killed when a test's own check fails on it (an assertion: the verdict
``fail``, or a regression test failing with another message); a mutant
that only makes tests error (it does not import, say) or passes them all
survives, and the command exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from .bases import (
    BaseUnavailable,
    find_user_repo,
    locked,
    repo_lock,
    with_pinned_base,
    worktree,
)
from .core import (
    UserError,
    command,
    common,
    git,
    patch_names,
    say,
)
from .lanes import TreeRing, in_lanes, lanes
from .pinned import fetched_dir
from .runner import PatchResult, apply_stack, positions, preimages, table
from .series import (
    Patch,
    Series,
    Stack,
    load_patch,
    parse_series,
    pick_patch,
    short_name,
)
from .testrun import aggregate, covers, run_tests, test_python


@dataclasses.dataclass
class Mutant:
    path: Path
    what: str
    tests: list[str]

    @property
    def name(self) -> str:
        return self.path.stem


def mutants_dir(series: Series, stack: Stack, patch: str) -> Path:
    return series.root / "tests" / "mutants" / stack.name / Path(patch).stem


def load_mutants(series: Series, stack: Stack, patch: str) -> list[Mutant]:
    out = []
    for f in sorted(mutants_dir(series, stack, patch).glob("*.diff")):
        head = f.read_text().split("\ndiff --git ", 1)[0]
        fields: dict[str, str] = {}
        for line in head.splitlines():
            key, sep, value = line.partition(":")
            if sep and key in ("Mutant", "Tests"):
                fields[key] = value.strip()
        if "Mutant" not in fields or "\ndiff --git " not in f.read_text():
            raise UserError(
                f"{f.relative_to(series.root)}: not a mutant (a 'Mutant:' line, "
                "then a git diff)"
            )
        out.append(Mutant(f, fields["Mutant"], fields.get("Tests", "").split()))
    return out


def lint_mutants(series: Series) -> list[str]:
    """Every mutant folder belongs to a patch of the series; every mutant
    parses and names only tests of its patch."""
    root = series.root / "tests" / "mutants"
    known = {(s.name, Path(p).stem): (s, p) for s in series.stacks for p in s.patches}
    probs = []
    for d in sorted(root.glob("*/*")) if root.is_dir() else []:
        key = (d.parent.name, d.name)
        if key not in known:
            probs.append(f"{d.relative_to(series.root)}: no such patch in the series")
            continue
        stack, entry = known[key]
        patch = load_patch(series, entry)
        try:
            for m in load_mutants(series, stack, entry):
                probs += [
                    f"{m.path.relative_to(series.root)}: '{t}' is not in "
                    f"{entry}'s Tests"
                    for t in m.tests
                    if not any(covers(pt, t) for pt in patch.tests)
                ]
        except UserError as e:
            probs.append(str(e))
    return probs


def run_mutant(series: Series, wt: Path, commit: str, m: Mutant, env: dict) -> dict:
    """Apply one mutant to a clean tree at `commit`, run its tests on it."""
    git("reset", "-q", "--hard", commit, cwd=wt)
    git("clean", "-fdq", "-e", "__pycache__", cwd=wt)
    t0 = time.monotonic()
    proc = git("apply", "--whitespace=nowarn", str(m.path), cwd=wt, check=False)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        return {
            "mutant": m.name,
            "outcome": "stale",
            "reason": f"does not apply: {err[-1] if err else '?'}",
        }
    outs, _ = run_tests(
        series.root,
        wt,
        m.tests,
        env["python"],
        f"mutant {m.name}",
        {
            "VLLM_BASE_TREE": env["base_tree"],
            # a mutant is killed by the first failure of a test's own check
            "VLLM_PATCHES_EXPECT_FAIL": "*",
            "VLLM_PATCHES_STOP_AT_KILL": "1",
        },
        warm=True,
    )
    killers = [t for t in m.tests if outs[t].asserted]
    worst = aggregate(list(outs.values()))
    res = {"mutant": m.name, "what": m.what, "seconds": round(time.monotonic() - t0, 1)}
    if killers:
        res.update(outcome="killed", by=killers)
    elif worst.verdict == "error":
        res.update(outcome="error", reason=worst.reason)
    else:
        res.update(outcome="survived")
    git("reset", "-q", "--hard", commit, cwd=wt)
    return res


def stack_mutants(
    series: Series,
    stack: Stack,
    wanted: list[str],
    user_repo: Path | None,
    args: argparse.Namespace,
) -> list[dict]:
    """Run the mutants of the stack's patches in `wanted`, each on the tree
    at its patch's position (the stack's pinned base plus the patches up to
    it), in lanes (lanes.py); VLLM_BASE_TREE is the tree just before it."""
    try:
        base, pinned = with_pinned_base(
            stack, args.base, user_repo, args.offline, fetched_dir(args)
        )
    except BaseUnavailable as e:
        say(f"apply.py mutants: stack {stack.name} skipped: {e.reason}")
        return [{"patch": p, "outcome": "skipped", "reason": e.reason} for p in wanted]
    patches = [load_patch(series, p) for p in stack.patches]
    results = {p.file: PatchResult(p.file) for p in patches}
    with locked(repo_lock(base.repo)):
        preimages(stack, patches, base, pinned)
        # The main job's worktrees (lanes.TreeRing): no others needed.
        top = worktree(base.repo, f"{stack.name}-at-0", base.commit)
        apply_stack(top, patches, results)
        commits = positions(base.commit, patches, results)
        return run_stack_mutants(
            series, stack, patches, (base.repo, commits), wanted, args
        )


def run_stack_mutants(
    series: Series,
    stack: Stack,
    patches: list[Patch],
    at: tuple[Path, list[str]],
    wanted: list[str],
    args: argparse.Namespace,
) -> list[dict]:
    """Every wanted mutant of the stack, side by side in lanes: each lane
    moves its own two trees (the patch's and the one before it). `at`: the
    repository and the commit at each position."""
    repo, commits = at
    jobs: list[tuple[int, Patch, Mutant | None]] = []
    for i, p in enumerate(patches):
        if p.file not in wanted:
            continue
        if commits[i + 1] == commits[i]:
            jobs.append((i, p, None))
            continue
        jobs += [
            (i, p, dataclasses.replace(m, tests=m.tests or p.tests))
            for m in load_mutants(series, stack, p.file)
            if not args.mutant or m.name in args.mutant
        ]
    n = lanes()
    rings = [TreeRing(repo, f"{stack.name}-at", None, None, k) for k in range(n)]
    python = test_python(args.python)

    def run(k: int, job: tuple[int, Patch, Mutant | None]) -> dict:
        i, p, m = job
        if m is None:
            return {"patch": p.file, "outcome": "skipped", "reason": "does not apply"}
        before = rings[k].at(commits[i], keep=commits[i + 1])
        wt = rings[k].at(commits[i + 1], keep=commits[i], mutable=True)
        env = {"python": python, "base_tree": str(before)}
        say(f"apply.py mutants: {p.file}: {m.name}")
        return {"patch": p.file, **run_mutant(series, wt, commits[i + 1], m, env)}

    return in_lanes(jobs, run, n)


def cmd_mutants(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    probs = lint_mutants(series)
    if probs:
        raise UserError(probs[0])
    stacks = {s.name: s for s in series.stacks}
    if args.patches:
        picked = []
        for w in args.patches:  # a stack's name, or one patch
            if w in stacks:
                st = stacks[w]
                picked += [(st, p) for p in st.patches if load_mutants(series, st, p)]
            else:
                picked.append(pick_patch(series, w))
    else:
        picked = [
            (s, p)
            for s in series.stacks
            for p in s.patches
            if load_mutants(series, s, p)
        ]
    user_repo = find_user_repo(args.repo)
    rows: list[dict] = []
    for stack in series.stacks:
        wanted = [p for s, p in picked if s is stack]
        if wanted:
            rows += stack_mutants(series, stack, wanted, user_repo, args)
    print_mutants(rows)
    bad = [r for r in rows if r["outcome"] not in ("killed", "skipped")]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"mutants": rows}, indent=2) + "\n")
    return 1 if bad else 0


def print_mutants(rows: list[dict]) -> None:
    lines = [("patch", "mutant", "outcome", "secs")]
    for r in rows:
        short = short_name(r["patch"])
        lines.append(
            (short, r.get("mutant", "-"), r["outcome"], str(r.get("seconds", "")))
        )
    for line in table(lines):
        print(line)
    for r in rows:
        if r["outcome"] == "killed":
            print(f"  {r['mutant']}: killed by {', '.join(r['by'])}")
        elif r["outcome"] != "skipped" or r.get("reason"):
            print(
                f"  {r.get('mutant', r['patch'])}: {r['outcome'].upper()}"
                + (f" ({r['reason']})" if r.get("reason") else "")
            )
    killed = sum(r["outcome"] == "killed" for r in rows)
    total = sum(r["outcome"] != "skipped" for r in rows)
    print(f"mutants: {killed} of {total} killed")


def add_mutants_command(sub: argparse._SubParsersAction) -> None:
    m = command(
        sub,
        "mutants",
        cmd_mutants,
        help="check that each patch's tests catch wrong fixes",
        description="Apply each mutant (tests/mutants/<stack>/<patch>/*.diff: "
        "the bug put back another way, or a plausible wrong fix) to the tree "
        "the patch makes, run the patch's tests, and fail when a mutant "
        "survives.",
        epilog="examples:\n  python apply.py mutants tq/0001\n"
        "  python apply.py mutants tq-v0.33",
    )
    patch_names(m, "stack names, patch file names or prefixes")
    m.add_argument("--base", default=None, help="base (default: each stack's pin)")
    m.add_argument("--json", help="write the results here")
    m.add_argument(
        "--mutant",
        action="append",
        metavar="NAME",
        help="run only this mutant (its file name without .diff; repeatable)",
    )
    common(m, "repo", "python", "offline", "fetched")
