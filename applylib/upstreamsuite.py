"""apply.py upstream: vLLM's own tests of the modules a stack changes, on
its base and on the patched tree, as vLLM's CI would run them (plain
pytest in vLLM's tree, vLLM's conftest). A test that passes on the base
and not patched is a regression the stack's PRs would bring upstream,
unless the patch carries that test's update: tests/upstream/<stack>/
<patch>.diff, applied to the patched tree's tests/ (and by export to the
PR in a vLLM clone).

The tests come from the base's own tree when it has them (a vLLM clone),
else from the release's sdist (applylib.sdist)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .bases import BaseUnavailable, find_user_repo, resolve_base, worktree
from .core import UserError, command, common, git
from .pinned import fetched_dir
from .runner import PatchResult, apply_stack
from .sdist import release_tests
from .series import Patch, Series, Stack, load_patch, parse_series
from .testrun import test_python
from .upstreamtest import HOST_PLUGIN, OUTCOME, SKIPPED, outcome, run_plain
from .wheelbuild import stack_release

# A module more of vLLM's test files import than this (arg_utils,
# platforms) is left to vLLM's CI: its suites are too wide for this check.
MAX_IMPORTERS = 10
BAD = ("failed", "error")


def upstream_diff(entry: str) -> Path:
    """Where the series keeps a patch's update of vLLM's own tests,
    relative to its root."""
    return Path("tests") / "upstream" / Path(entry).with_suffix(".diff")


def upstream_test_dir(entry: str) -> Path:
    """Where the series keeps a patch's own test written for vLLM, beside
    its update of vLLM's tests (tests/upstream/<stack>/<patch>/), relative
    to its root."""
    return upstream_diff(entry).with_suffix("")


def upstream_tests(root: Path, entry: str) -> list[str]:
    """The files of a patch's own test for vLLM (upstream_test_dir): each
    one's path in vLLM's tree (the path below that folder), sorted; []
    when it has none."""
    kept = root / upstream_test_dir(entry)
    files = kept.rglob("*") if kept.is_dir() else ()
    return sorted(
        f.relative_to(kept).as_posix()
        for f in files
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
    )


def upstream_diffs(root: Path, stack: Stack) -> list[Path]:
    """The stack's patches' updates of vLLM's tests, in series order."""
    return [
        root / upstream_diff(p)
        for p in stack.patches
        if (root / upstream_diff(p)).is_file()
    ]


def touched_modules(files: list[str]) -> list[str]:
    """The dotted names of the vLLM modules among `files`."""
    return sorted(
        {
            f[:-3].replace("/", ".")
            for f in files
            if f.startswith("vllm/") and f.endswith(".py")
        }
    )


def importers(tests: Path, module: str) -> list[str]:
    """vLLM's test files (tests/...test_*.py) that import `module`."""
    pkg, _, stem = module.rpartition(".")
    pat = re.compile(
        rf"{re.escape(module)}\b|from {re.escape(pkg)} import [^\n]*\b{stem}\b"
    )
    return sorted(
        "tests/" + f.relative_to(tests).as_posix()
        for f in tests.rglob("test_*.py")
        if pat.search(f.read_text(errors="replace"))
    )


def suite_files(tests: Path, modules: list[str]) -> tuple[list[str], list[str]]:
    """The test files to run, and a note per module left out."""
    files: set[str] = set()
    notes = []
    for m in modules:
        found = importers(tests, m)
        if len(found) > MAX_IMPORTERS:
            notes.append(f"{m}: imported by {len(found)} test files, left to vLLM CI")
        else:
            files.update(found)
    return sorted(files), notes


def outcomes(
    tree: Path, files: list[str], python: str, skips_of: Iterable[str] = ()
) -> dict[str, str]:
    """Each test's outcome under plain pytest in `tree` (the worst reported:
    a pass with an error at teardown is an error); each file of `skips_of`
    that pytest skipped whole, as "skipped (REASON)"."""
    if not files:
        return {}
    p = run_plain(
        tree, ["--continue-on-collection-errors", *files], python, HOST_PLUGIN
    )
    rank = {"passed": 0, "xfail": 0, "xpass": 1, "failed": 2, "error": 3}
    seen: dict[str, str] = {}
    skips: dict[str, str] = {}
    for line in p.stdout.splitlines():
        m = OUTCOME.match(line)
        if m:
            got, old = m.group(1).lower(), seen.get(m.group(2))
            if old is None or rank.get(got, 0) > rank.get(old, 0):
                seen[m.group(2)] = got
        elif (m := SKIPPED.match(line)) and m.group(1) in skips_of:
            skips.setdefault(m.group(1), m.group(2))
    for f, why in skips.items():  # skipped whole: none of its tests reported
        if not any(t == f or t.startswith(f + "::") for t in seen):
            seen[f] = f"skipped ({why})"
    if not seen and p.returncode not in (0, 5):
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        raise UserError(f"vLLM's tests did not run in {tree}: {' / '.join(tail)}")
    return seen


def tree_with_tests(tree: Path, tests: Path, diffs: list[Path]) -> None:
    """vLLM's tests/ put into the worktree `tree` (untracked) where it has
    none, then the patches' test updates applied."""
    if not (tree / "tests").is_dir():
        shutil.copytree(tests, tree / "tests")
    for d in diffs:
        if shutil.which("git"):
            p = git("apply", str(d), cwd=tree, check=False)
        else:  # a bare machine (the GPU rig's)
            cmd = ["patch", "-p1", "-s", "--forward", "-i", str(d)]
            p = subprocess.run(cmd, cwd=tree, capture_output=True, check=False)
        if p.returncode != 0:
            err = (p.stderr or p.stdout).decode(errors="replace").strip().splitlines()
            raise UserError(f"{d}: does not apply to vLLM's tests: {err[:1]}")


def regressions(
    was: dict[str, str], now: dict[str, str], updated: set[str]
) -> tuple[list[str], list[str]]:
    """The tests that passed on the base and do not with the stack, and
    those the patches' test updates renamed or removed (in a file they
    change, not run patched)."""
    gone = [t for t, o in was.items() if o == "passed" and t not in now]
    moved = [t for t in gone if t.split("::", 1)[0] in updated]
    bad = [
        t
        for t, o in was.items()
        if o == "passed" and now.get(t, "not run") != "passed" and t not in moved
    ]
    return bad, moved


def diff_files(diffs: list[Path]) -> set[str]:
    """The files the test updates change."""
    out: set[str] = set()
    for d in diffs:
        out.update(re.findall(r"^\+\+\+ b/(\S+)$", d.read_text(), re.MULTILINE))
    return out


def summary(outs: dict[str, str]) -> str:
    counts = Counter(outs.values())
    return ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "none"


def check_stack(args: argparse.Namespace, series: Series, stack: Stack) -> int:
    """One stack: its base and patched trees with vLLM's tests, compared."""
    user_repo = find_user_repo(args.repo)
    try:
        base = resolve_base(
            stack, args.base, user_repo, args.offline, fetched_dir(args)
        )
    except BaseUnavailable as e:
        raise UserError(f"base unavailable: {e.reason} (to get it: {e.hint})") from None
    patches = [load_patch(series, e) for e in stack.patches]
    was_wt = worktree(base.repo, f"{stack.name}-upstream-base", base.commit)
    now_wt = worktree(base.repo, f"{stack.name}-upstream-patched", base.commit)
    results = {p.file: PatchResult(p.file) for p in patches}
    left = apply_stack(now_wt, patches, results)
    if (was_wt / "tests").is_dir():
        tests, where = was_wt / "tests", f"the tests of {base.rev} in {base.repo}"
    else:
        release = stack_release(stack, args.base, base)
        if release is None:
            print(f"{stack.name}: {base.rev} is no release and has no tests/: skipped")
            return 0
        try:
            tests, where = release_tests(release), f"vllm {release}'s sdist"
        except BaseUnavailable as e:
            raise UserError(f"{e.reason} (or: {e.hint})") from None
    print(f"{stack.name}: vLLM's tests of the modules its patches change ({where})")
    if left:
        print(f"  not applied: {', '.join(p.file for p in left)}")
    return compare_trees(
        series.root, stack, patches, (was_wt, now_wt), tests, test_python(args.python)
    )


def compare_trees(
    root: Path,
    stack: Stack,
    patches: list[Patch],
    trees: tuple[Path, Path],
    tests: Path,
    python: str,
) -> int:
    """vLLM's tests of what `patches` change, run on the base tree and the
    patched one (the patches' test updates applied there): the report's
    lines, and 1 when a test the base passes does not pass patched. The GPU
    rig calls this with its unpacked trees."""
    modules = touched_modules([f for p in patches for f in p.files])
    files, notes = suite_files(tests, modules)
    diffs = upstream_diffs(root, stack)
    tree_with_tests(trees[0], tests, [])
    tree_with_tests(trees[1], tests, diffs)
    kept = kept_tests(root, stack, trees)
    for n in notes:
        print(f"  not run: {n}")
    for f in files:
        print(f"  {f}")
    for d in diffs:
        print(f"  with the update {d.relative_to(root)}")
    run = files + [f for f in kept if f not in files]
    was = outcomes(trees[0], run, python, kept)
    now = outcomes(trees[1], run, python, kept)
    own = {t for t in was.keys() | now.keys() if t.split("::", 1)[0] in kept}
    rc = report(
        {t: o for t, o in was.items() if t not in own},
        {t: o for t, o in now.items() if t not in own},
        diff_files(diffs),
    )
    return max(rc, report_kept(kept, was, now))


def kept_tests(root: Path, stack: Stack, trees: tuple[Path, Path]) -> dict[str, str]:
    """The stack's patches' own tests for vLLM (upstream_tests) copied into
    both trees: their vLLM path -> the patch."""
    kept = {}
    for entry in stack.patches:
        src = root / upstream_test_dir(entry)
        for rel in upstream_tests(root, entry):
            for tree in trees:
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, tree / rel)
            kept[rel] = entry
    return kept


def report_kept(kept: dict[str, str], was: dict[str, str], now: dict[str, str]) -> int:
    """Each kept test file: proven when it fails on the base and all of it
    passes patched; 1 when one is not (skipped on both: not run here, and
    why where pytest said)."""
    bad = 0
    for path, entry in kept.items():
        before, after = outcome(path, was), outcome(path, now)
        if not_run(before) and not_run(after):
            why = after if after != "not run" else "skipped on this host"
            print(f"  kept {path} ({entry}): not run here, {why}")
            continue
        ok = before == "failed" and after == "passed"
        bad |= not ok
        print(
            f"  {'kept' if ok else 'NOT PROVEN'} {path} ({entry}): {before} on the "
            f"base, {after} patched"
        )
    return int(bad)


def not_run(outcome_: str) -> bool:
    return outcome_ == "not run" or outcome_.startswith("skipped")


def report(was: dict[str, str], now: dict[str, str], updated: set[str]) -> int:
    """What changed between the base and the patched tree; 1 when a test
    the base passes does not pass patched."""
    print(f"  base: {summary(was)}")
    print(f"  patched: {summary(now)}")
    bad, moved = regressions(was, now, updated)
    for t in moved:
        print(f"  updated {t}: renamed or removed by the update")
    for t in bad:
        print(f"  REGRESSION {t}: passed on the base, {now.get(t, 'not run')} patched")
    fixed = [t for t, o in now.items() if o == "passed" and was.get(t) in BAD]
    for t in fixed:
        print(f"  fixed {t}: {was[t]} on the base, passed patched")
    return 1 if bad else 0


def cmd_upstream(args: argparse.Namespace) -> int:
    """apply.py upstream [STACK...]: exit 1 when a stack breaks a vLLM test."""
    series = parse_series(Path(args.series))
    names = args.stacks or [s.name for s in series.stacks]
    unknown = [n for n in names if n not in {s.name for s in series.stacks}]
    if unknown:
        raise UserError(f"no stack named {', '.join(unknown)} in {args.series}")
    rc = 0
    for stack in (s for s in series.stacks if s.name in names):
        rc = max(rc, check_stack(args, series, stack))
    return rc


def add_upstream_command(sub: argparse._SubParsersAction) -> None:
    u = command(
        sub,
        "upstream",
        cmd_upstream,
        help="run vLLM's own tests of the modules a stack changes, base and patched",
        description="Run vLLM's own test files that import a module the "
        "stack's patches change (from the base's tests/, else the release's "
        "sdist), on the base and on the patched tree with the patches' test "
        "updates (tests/upstream/<stack>/<patch>.diff); exit 1 when a test "
        "that passes on the base does not pass patched.",
        epilog="example:\n  python apply.py upstream tq-v0.33",
    )
    u.add_argument("stacks", nargs="*", help="stack names (default: all)")
    common(u, "base", "repo", "python", "offline", "fetched")
