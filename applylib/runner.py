"""Applying a stack with git am, judging each patch at its position in the
series, and the main job."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from .bases import (
    Base,
    BaseUnavailable,
    cache_repo,
    find_user_repo,
    locked,
    ref_label,
    repo_lock,
    with_pinned_base,
    worktree,
)
from .choose import stacks_for_base
from .core import (
    AM_CONFIG,
    REF_NS,
    git,
    gout,
)
from .lanes import TreeRing, in_lanes, lanes
from .pinned import fetched_dir
from .series import Patch, Series, Stack, check_agreement, load_patch, parse_series
from .testrun import Outcome, aggregate, run_tests, test_python

APPLIED = ("clean", "3way")


@dataclasses.dataclass
class PatchResult:
    file: str
    apply: str = "skipped"  # clean | 3way | conflict | not-needed | skipped
    regression_base: str = "skip"
    regression_patched: str = "skip"
    tests: str = "skip"
    skipped: int = 0
    seconds: float = 0.0
    commit: str | None = None  # the patch's commit in the tool's worktree
    already_applied: bool = False  # git am: "No changes -- already applied"
    conflict_files: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    test_outcomes: dict[str, dict[str, dict]] = dataclasses.field(default_factory=dict)

    def ok(self) -> bool:
        if self.apply == "not-needed":
            return True
        return (
            self.apply in APPLIED
            and self.regression_base == "fail"
            and self.regression_patched == "pass"
            and self.tests == "pass"
        )

    def verdicts(self) -> list[str]:
        return [self.regression_base, self.regression_patched, self.tests]

    def to_json(self) -> dict:
        d = {
            "file": self.file,
            "apply": self.apply,
            "regression": {
                "base": self.regression_base,
                "patched": self.regression_patched,
            },
            "tests": self.tests,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 2),
        }
        for k in ("commit", "conflict_files", "detail", "reasons", "test_outcomes"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        return d


def git_am(wt: Path, *args: str) -> subprocess.CompletedProcess:
    """git am in the tool's worktree, never with the user's configuration
    (git am refuses to start, even to --quit or --abort, without an
    identity: the tool brings its own)."""
    return git("am", *args, cwd=wt, check=False, config=AM_CONFIG)


def am(wt: Path, patches: list[Path], three_way: bool) -> subprocess.CompletedProcess:
    return git_am(
        wt,
        "-q",
        "-k",
        "--committer-date-is-author-date",
        "--3way" if three_way else "--no-3way",
        *map(str, patches),
    )


def commits_since(wt: Path, start: str) -> list[str]:
    return gout("rev-list", "--reverse", f"{start}..HEAD", cwd=wt).split()


def conflicted_files(wt: Path, am_output: str, patch: Patch) -> list[str]:
    """Files left unmerged by git am -3, else those git named when it could
    not even merge (no base blobs: 'sha1 information is lacking'), else the
    files the patch touches."""
    files = gout("diff", "--name-only", "--diff-filter=U", cwd=wt).splitlines()
    if not files:
        for m in re.finditer(
            r"error: (?:patch failed: |)([^:\s]+)(?::\d+| does not"
            r" exist in index|: No such file)|lacking or useless \((\S+)\)",
            am_output,
        ):
            f = m.group(1) or m.group(2)
            if f not in files:
                files.append(f)
    return files or list(patch.files)


def apply_one_3way(wt: Path, p: Patch, res: PatchResult, first_try: str) -> bool:
    """Retry one patch with the 3-way fallback. True when it made exactly
    one commit. A patch whose changes the tree already holds ("No changes
    -- Patch already applied": exit 0, no commit) is marked
    already_applied; a real conflict leaves the worktree as it was."""
    pre = gout("rev-parse", "HEAD", cwd=wt)
    t0 = time.monotonic()
    proc = am(wt, [p.path], three_way=True)
    res.seconds += time.monotonic() - t0
    made = commits_since(wt, pre)
    if proc.returncode == 0 and len(made) == 1:
        res.apply, res.commit = "3way", made[0]
        return True
    res.apply = "conflict"
    out = first_try + (proc.stdout + proc.stderr).decode(errors="replace")
    if proc.returncode == 0:
        res.already_applied = True
        res.detail = "git am: no changes, the tree already holds this patch"
    else:
        res.conflict_files = conflicted_files(wt, out, p)
        res.detail = "; ".join(
            ln for ln in out.splitlines() if ln.startswith("error:")
        )[:500]
    git_am(wt, "--abort")
    git("reset", "-q", "--hard", pre, cwd=wt)
    return False


def preimages(
    stack: Stack, patches: list[Patch], base: Base, pinned: Base | None
) -> None:
    """Put the blobs every patch was made on into the base's repository: the
    stack applied on its pin, in a worktree of its own. git am's 3-way
    fallback merges from them; without them its outcome on another base
    would depend on what earlier runs left in the repository."""
    if pinned is not None and pinned.repo == base.repo:
        wt = worktree(base.repo, f"{stack.name}-pin", pinned.commit)
        apply_stack(wt, patches, {p.file: PatchResult(p.file) for p in patches})


def apply_stack(
    wt: Path, patches: list[Patch], results: dict[str, PatchResult]
) -> list[Patch]:
    """git am the patches in order; returns those that did not apply.

    The whole stack goes through one git am, as fast as plain git am. A patch
    that does not apply as is is retried alone with the 3-way fallback.
    Patches that do not apply are left out (their later patches still
    tried). Every applied patch made exactly one commit (results' commit).
    """
    todo = list(patches)
    failed: list[Patch] = []
    while todo:
        start = gout("rev-parse", "HEAD", cwd=wt)
        t0 = time.monotonic()
        proc = am(wt, [p.path for p in todo], three_way=False)
        made = commits_since(wt, start)
        dt = (time.monotonic() - t0) / max(1, len(made) + (proc.returncode != 0))
        for p, c in zip(todo, made, strict=False):
            results[p.file].apply, results[p.file].commit = "clean", c
            results[p.file].seconds += dt
        if proc.returncode == 0 and len(made) == len(todo):
            break
        git_am(wt, "--quit")
        git("reset", "-q", "--hard", "HEAD", cwd=wt)
        stuck, todo = todo[len(made)], todo[len(made) + 1 :]
        first = (proc.stdout + proc.stderr).decode(errors="replace")
        if not apply_one_3way(wt, stuck, results[stuck.file], first):
            failed.append(stuck)
    return failed


# --------------------------------------------------------------------------
# Judging: each patch at its own position in the series
# --------------------------------------------------------------------------


def positions(base_commit: str, patches: list[Patch], results) -> list[str]:
    """The tree at each position: [base, base+p1, base+p1+p2, ...] (a patch
    that did not apply leaves the tree as it was)."""
    commits = [base_commit]
    for p in patches:
        commits.append(results[p.file].commit or commits[-1])
    return commits


def test_plan(
    patches: list[Patch], results: dict[str, PatchResult], full: bool
) -> dict[int, list[str]]:
    """Node ids to run at each position. A patch's regression tests run on
    the tree before it (they must fail there); with `full`, its regression
    and other targeted tests on the tree with it (they must pass), and its
    regression tests again on the whole stack (no later patch undoes it)."""
    plan: dict[int, list[str]] = {}

    def add(j: int, ids: list[str]) -> None:
        have = plan.setdefault(j, [])
        have += [t for t in ids if t not in have]

    last = len(patches)
    for i, p in enumerate(patches):
        add(i, p.regression)
        if full and results[p.file].apply in APPLIED:
            add(i + 1, p.regression + p.tests)
            if i + 1 != last:
                add(last, p.regression)
    return plan


@dataclasses.dataclass
class Runs:
    """One stack's pytest runs: the node ids of `plan` at each position of
    `commits` (run_all's arguments), and, once run, their outcomes, logs
    and wall seconds by position. `top`: a worktree already at the last
    position. `expect_fail`: the node ids whose failure is the expected
    outcome at each position (they are not shrunk); None: every one."""

    repo: Path
    key: str
    commits: list[str]
    plan: dict[int, list[str]]
    top: Path | None = None
    expect_fail: dict[int, list[str]] | None = None
    outs: dict[int, dict[str, Outcome]] = dataclasses.field(default_factory=dict)
    logs: dict[int, str] = dataclasses.field(default_factory=dict)
    wall: dict[int, float] = dataclasses.field(default_factory=dict)

    def by_tree(self) -> tuple[dict[str, int], dict[int, list[str]], dict[int, set]]:
        """One pytest run per distinct tree: the first position of each
        commit, the node ids run there, and those expected to pass."""
        first: dict[str, int] = {}
        for j, c in enumerate(self.commits):
            first.setdefault(c, j)
        ids_at: dict[int, list[str]] = {}
        passing: dict[int, set[str]] = {}
        for j, ids in sorted(self.plan.items()):
            have = ids_at.setdefault(first[self.commits[j]], [])
            have += [t for t in ids if t not in have]
            want = self.expect_fail
            fails = want.get(j, []) if want is not None else ids
            passing.setdefault(first[self.commits[j]], set()).update(
                t for t in ids if t not in fails
            )
        return first, ids_at, passing


def run_all(series: Series, stacks: list[Runs], python: str) -> None:
    """Every stack's runs in one set of lanes (lanes.py: each lane's two
    worktrees per stack serve its positions in turn, not one per patch),
    so no lane idles while another stack has runs left. The tests at a
    position see the tree just before it as VLLM_BASE_TREE (what an
    unpatched-vs-patched comparison needs)."""
    trees = [r.by_tree() for r in stacks]
    # the runs with the most node ids first: the longest ones do not come
    # last, with the other lanes idle
    order = [(i, j) for i, (_, ids_at, _) in enumerate(trees) for j in ids_at]
    order.sort(key=lambda ij: -len(trees[ij[0]][1][ij[1]]))
    rings: dict[tuple[int, int], TreeRing] = {}

    def run(k: int, ij: tuple[int, int]) -> tuple[dict[str, Outcome], str]:
        t0 = time.monotonic()
        (i, j), r = ij, stacks[ij[0]]
        _, ids_at, passing = trees[i]
        ring = rings.setdefault(
            (i, k), TreeRing(r.repo, r.key, r.top, r.commits[-1], k)
        )
        prev = r.commits[j - 1] if j > 0 else None
        tree = ring.at(r.commits[j], keep=prev)
        fails = [t for t in ids_at[j] if t not in passing[j]]
        extra = {"VLLM_PATCHES_EXPECT_FAIL": "\n".join(fails)}
        if prev is not None:
            extra["VLLM_BASE_TREE"] = str(ring.at(prev, keep=r.commits[j]))
        label = "unpatched base" if j == 0 else f"with {j} patch(es)"
        got = run_tests(
            series.root, tree, ids_at[j], python, f"{r.key}, {label}", extra, warm=True
        )
        r.wall[j] = round(time.monotonic() - t0, 1)
        return got

    done = dict(zip(order, in_lanes(order, run, lanes()), strict=True))
    for i, r in enumerate(stacks):
        first = trees[i][0]
        r.outs = {j: done[i, first[r.commits[j]]][0] for j in r.plan}
        r.logs = {j: log for (ii, j), (_, log) in done.items() if ii == i}


def run_positions(
    series: Series,
    repo: Path,
    key: str,
    commits: list[str],
    plan: dict[int, list[str]],
    python: str,
) -> tuple[dict[int, dict[str, Outcome]], dict[int, str]]:
    """One stack's plan, run (run_all); every failure is a verdict."""
    r = Runs(repo, key, commits, plan)
    run_all(series, [r], python)
    return r.outs, r.logs


def ran(o: Outcome) -> Outcome:
    """A regression verdict: a pass only if a test actually ran."""
    if o.verdict == "pass" and o.passed == 0:
        return Outcome("skip", "did not run here (device-only test)", o.seconds)
    return o


def judge(
    patches: list[Patch],
    results: dict[str, PatchResult],
    outs: dict[int, dict[str, Outcome]],
    full: bool = True,
) -> None:
    """Turn the outcomes per position (test_plan's) into each patch's
    verdicts; without `full`, the regression verdicts without it only."""
    last = len(patches)
    for i, p in enumerate(patches):
        r = results[p.file]
        before = ran(aggregate([outs[i][t] for t in p.regression]))
        r.regression_base = before.verdict
        r.seconds += before.seconds
        r.test_outcomes["base"] = {t: outs[i][t].to_json() for t in p.regression}
        if before.reason and before.verdict != "pass":
            r.reasons["regression_base"] = before.reason
        if r.apply == "conflict" and before.verdict == "pass":
            r.apply = "not-needed"
            r.detail = (
                "already in the base, and its regression tests pass there"
                if r.already_applied
                else "does not apply, and its regression tests pass without it"
            )
        if r.apply not in APPLIED or not full:
            continue
        own = outs[i + 1]
        reg = [own[t] for t in p.regression]
        if i + 1 != last:
            reg += [outs[last][t] for t in p.regression]
            r.test_outcomes["stack"] = {
                t: outs[last][t].to_json() for t in p.regression
            }
        after = ran(aggregate(reg))
        tests = aggregate([own[t] for t in p.tests])
        r.regression_patched, r.tests = after.verdict, tests.verdict
        r.skipped = tests.skipped + tests.device_skipped
        r.seconds += tests.seconds
        r.test_outcomes["patched"] = {t: own[t].to_json() for t in p.tests}
        for k, o in (("regression_patched", after), ("tests", tests)):
            if o.reason and o.verdict != "pass":
                r.reasons[k] = o.reason


# --------------------------------------------------------------------------
# The main job
# --------------------------------------------------------------------------


@dataclasses.dataclass
class StackRun:
    """A stack on its way through the main job: applied, its runs planned
    (none with --no-tests), judged once they ran."""

    rep: dict
    patches: list[Patch]
    results: dict[str, PatchResult]
    runs: Runs | None = None
    seconds: float = 0.0


def prepare_stack(
    series: Series,
    stack: Stack,
    patches: list[Patch],
    rev: str | None,
    user_repo: Path | None,
    args: argparse.Namespace,
    hold: Callable[[Path], None],
) -> StackRun:
    """The stack's base and patched tree, and its plan of runs; `hold`
    takes the base repository's lock until the main job ends."""
    t0 = time.monotonic()
    rep: dict = {
        "name": stack.name,
        "pins": stack.pins,
        "base": rev or stack.pins.get("tag") or stack.pins.get("commit"),
    }
    results = {p.file: PatchResult(p.file) for p in patches}
    try:
        base, pinned = with_pinned_base(
            stack, rev, user_repo, args.offline, fetched_dir(args), args.python
        )
    except BaseUnavailable as e:
        rep.update(status="skipped", reason=e.reason, fetch=e.hint)
        rep["patches"] = [PatchResult(p).to_json() for p in stack.patches]
        return StackRun(rep, patches, results)
    rep.update(
        base=base.rev, base_commit=base.commit, source=base.source, repo=str(base.repo)
    )
    if base.upstream_commit:
        rep["upstream_commit"] = base.upstream_commit
    if base.source == "fetched":
        rep.update(fetched=base.fetched, assembled=base.assembled)
    hold(base.repo)
    preimages(stack, patches, base, pinned)
    wt = worktree(base.repo, f"{stack.name}-patched", base.commit)
    apply_stack(wt, patches, results)
    head = gout("rev-parse", "HEAD", cwd=wt)
    branch = f"{REF_NS}/{stack.name}/{ref_label(base.rev)}"
    git("update-ref", branch, head, cwd=base.repo)
    rep.update(branch=branch, head=head, worktree=str(wt), status="ran")
    sr = StackRun(rep, patches, results)
    if not args.no_tests:
        sr.runs = Runs(
            base.repo,
            f"{stack.name}-at",
            positions(base.commit, patches, results),
            test_plan(patches, results, full=True),
            top=wt,
            expect_fail={i: p.regression for i, p in enumerate(patches)},
        )
    sr.seconds = time.monotonic() - t0
    return sr


def finish_stack(sr: StackRun, args: argparse.Namespace) -> dict:
    """The stack's report, from its runs' outcomes. Its seconds: its
    set-up and its pytest runs' (which shared the lanes with the other
    stacks' runs)."""
    rep, patches, results = sr.rep, sr.patches, sr.results
    if rep.get("status") != "ran":
        return rep
    if sr.runs is not None:
        judge(patches, results, sr.runs.outs)
        rep["position_seconds"] = {str(j): s for j, s in sr.runs.wall.items()}
        rep["logs"] = {str(j): log[-20000:] for j, log in sr.runs.logs.items()}
        sr.seconds += sum(sr.runs.wall.values())
    rep["patches"] = [results[p.file].to_json() for p in patches]
    rep["ok"] = (
        all(results[p.file].ok() for p in patches)
        if not args.no_tests
        else all(results[p.file].apply in APPLIED for p in patches)
    )
    rep["errors"] = sum(
        "error" in results[p.file].verdicts() for p in patches if not args.no_tests
    )
    rep["seconds"] = round(sr.seconds, 2)
    return rep


def run_stacks(
    series: Series,
    stacks: list[Stack],
    loaded: dict[str, Patch],
    user_repo: Path | None,
    args: argparse.Namespace,
) -> list[dict]:
    """Each stack applied in turn, then every stack's runs in one set of
    lanes, under the lock of each base repository (one run at a time per
    repository: the worktrees are shared state)."""
    with contextlib.ExitStack() as held:
        names: set[str] = set()

        def hold(repo: Path) -> None:
            name = repo_lock(repo)
            if name not in names:
                names.add(name)
                held.enter_context(locked(name))

        prepared = [
            prepare_stack(
                series,
                st,
                [loaded[p] for p in st.patches],
                args.base,
                user_repo,
                args,
                hold,
            )
            for st in stacks
        ]
        runs = [sr.runs for sr in prepared if sr.runs is not None]
        if runs:
            run_all(series, runs, test_python(args.python))
        return [finish_stack(sr, args) for sr in prepared]


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, r in enumerate(rows):
        cells = (c.ljust(w) for c, w in zip(r, widths, strict=True))
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def print_stack(st: dict) -> None:
    src = st["source"]
    if src == "fetched":  # assembled from a release and the pinned files
        n = len(st["assembled"]["files"])
        src = (
            f"fetched {st['fetched']}: {st['assembled']['release']} + "
            f"{n} pinned file{'s' if n != 1 else ''}"
        )
    up = f", upstream {st['upstream_commit']}" if st.get("upstream_commit") else ""
    print(
        f"== stack {st['name']} on {st['base']} ({st['base_commit'][:12]}, "
        f"from {src}{up})"
    )
    rows = [("patch", "apply", "regr. base", "regr. patched", "tests", "skip", "secs")]
    for p in st["patches"]:
        rows.append(
            (
                p["file"],
                p["apply"],
                p["regression"]["base"],
                p["regression"]["patched"],
                p["tests"],
                str(p.get("skipped", 0)),
                f"{p['seconds']:.1f}",
            )
        )
    for line in table(rows):
        print("  " + line)
    for p in st["patches"]:
        if p.get("conflict_files"):
            print(f"  {p['file']}: conflicts in {', '.join(p['conflict_files'])}")
        if p.get("detail") and not p.get("conflict_files"):
            print(f"  {p['file']}: {p['detail']}")
        for k, why in p.get("reasons", {}).items():
            print(f"  {p['file']}: {k.replace('_', ' ')}: {why}")
    print(
        f"  result: {'OK' if st['ok'] else 'FAILED'}; patched tree: "
        f"{st['branch']} in {st['repo']}"
    )


def print_table(report: dict) -> None:
    for st in report["stacks"]:
        print()
        if st["status"] == "skipped":
            print(
                f"== stack {st['name']}: SKIPPED, not verified: base "
                f"{st['base']} unavailable"
            )
            print(f"   reason: {st['reason']}")
            print(f"   to get it: {st['fetch']}")
            continue
        print_stack(st)
    skipped = [s for s in report["stacks"] if s["status"] == "skipped"]
    if skipped:
        print()
        print(
            "WARNING: not verified (base unavailable): "
            + ", ".join(s["name"] for s in skipped)
        )


def cmd_apply(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    loaded = {p: load_patch(series, p) for s in series.stacks for p in s.patches}
    user_repo = find_user_repo(args.repo)
    stacks = stacks_for_base(
        series, args, user_repo, dry_apply(series, user_repo, args)
    )
    report = {
        "tool": "apply.py",
        "series": str(series.path),
        "stacks": run_stacks(series, stacks, loaded, user_repo, args),
    }
    ran_ = [s for s in report["stacks"] if s["status"] == "ran"]
    failed = [s for s in ran_ if not s["ok"]]
    skipped = [s for s in report["stacks"] if s["status"] == "skipped"]
    code = 1 if failed or (args.require_all and skipped) or not ran_ else 0
    report["exit_code"] = code
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return code


def dry_apply(series: Series, user_repo: Path | None, args: argparse.Namespace):
    """A stack applied on --base without tests (what chooses between two
    neighbouring stacks): the files of its patches that do not apply, each
    with the file it changes that the base lacks (missing_file), or None
    where the base cannot be had."""

    def run(stack: Stack) -> dict[str, str] | None:
        with locked(repo_lock(user_repo or cache_repo())):
            base, res, _ = try_apply(series, stack, args.base, user_repo, args, "dry")
        if base is None:
            return None
        failed = [
            load_patch(series, f) for f, r in res.items() if r.apply not in APPLIED
        ]
        return {p.file: missing_file(base, p) for p in failed}

    return run


def missing_file(base: Base, patch: Patch) -> str:
    """A file `patch` changes (not one it adds) that `base` does not have:
    the component it fixes is not there ("not applicable"); "" if none."""
    added = set(
        re.findall(
            r"^diff --git a/\S+ b/(\S+)\nnew file mode",
            patch.raw.decode(errors="replace"),
            re.MULTILINE,
        )
    )
    for f in patch.files:
        have = git("cat-file", "-e", f"{base.commit}:{f}", cwd=base.repo, check=False)
        if f not in added and have.returncode != 0:
            return f
    return ""


def try_apply(
    series: Series,
    stack: Stack,
    rev: str,
    user_repo: Path | None,
    args: argparse.Namespace,
    key: str,
) -> tuple[Base | None, dict[str, PatchResult], str]:
    try:
        base, pinned = with_pinned_base(
            stack, rev, user_repo, args.offline, fetched_dir(args), args.python
        )
    except BaseUnavailable as e:
        return None, {}, e.reason
    patches = [load_patch(series, p) for p in stack.patches]
    preimages(stack, patches, base, pinned)
    res = {p.file: PatchResult(p.file) for p in patches}
    wt = worktree(base.repo, f"{stack.name}-{key}", base.commit)
    apply_stack(wt, patches, res)
    return base, res, ""
