"""rebase (--continue/--skip/--abort, --time-machine): carry a stack to a
new base, resumable after a conflict.

A rebase is a few steps over its state (a `Session`, kept in the tool's
cache, never in the project, with the new patch files staged beside it):

  start    resolve the new base, apply the old stack on its old base (for
           the range-diff), save the state;
  run      git am each patch in turn: keep it (clean, 3way), record it
           not-needed (its regression tests pass without it), or stop for
           a hand port;
  resume   after a stop: --continue (the resolution must pass the patch's
           regression tests), --skip (drop the patch), --abort;
  finish   the staged patch files into patches/, the series re-pinned (or
           a new stack with --as), a branch, the range-diff.

The series and patches/ change only when the whole rebase has succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

from .bases import (
    Base,
    BaseUnavailable,
    cache_dir,
    find_user_repo,
    ref_label,
    resolve_base,
    worktree,
)
from .core import (
    PROJECT,
    RECORDS,
    REF_NS,
    UserError,
    atomic_write,
    command,
    common,
    format_patch,
    git,
    gout,
    say,
)
from .pinned import fetched_dir
from .ranges import parse_range
from .runner import (
    PatchResult,
    am,
    apply_stack,
    commits_since,
    conflicted_files,
    git_am,
    ran,
    try_apply,
)
from .series import (
    Patch,
    Series,
    Stack,
    check_agreement,
    load_patch,
    parse_series,
)
from .seriesedit import new_pins, write_patches
from .testrun import aggregate, run_tests, test_python


@dataclasses.dataclass
class Session:
    """A rebase of one stack: its state (DIR/state.json) and the patch files
    staged for it (DIR/staged/), DIR being the series' folder in the tool's
    cache."""

    series: Series
    args: argparse.Namespace
    dir: Path
    state: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, series: Series, args: argparse.Namespace) -> Session:
        key = hashlib.sha1(str(series.path).encode()).hexdigest()[:10]
        return cls(series, args, cache_dir() / "rebase" / key)

    @property
    def file(self) -> Path:
        return self.dir / "state.json"

    def load(self) -> dict | None:
        if not self.file.exists():
            return None
        self.state = json.loads(self.file.read_text())
        return self.state

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.file, json.dumps(self.state, indent=1).encode())

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def stale(self) -> bool:
        """A 'running' state whose process is gone: a crashed rebase."""
        if self.state.get("phase") != "running":
            return False
        try:
            os.kill(int(self.state["pid"]), 0)
        except (OSError, ValueError):
            return True
        return False

    def keep(self, p: Patch, wt: Path, outcome: str) -> None:
        """The patch's commit (HEAD of `wt`) staged as its new file."""
        st = self.state
        staged = self.dir / "staged" / p.file
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(format_patch(wt, "HEAD"))
        st["staged"][p.file] = str(staged)
        st["results"].append({"file": p.file, "outcome": outcome})
        st["next"] += 1
        self.save()

    def record(self, p: Patch, kind: str, reason: str) -> None:
        """The patch left behind: a '#@ not-needed' or '#@ dropped' record."""
        st = self.state
        st["results"].append({"file": p.file, "outcome": kind, "reason": reason})
        st["next"] += 1
        self.save()


# start ------------------------------------------------------------------
def start(rb: Session, stack: Stack, onto: str, user_repo: Path | None) -> int:
    if rb.load():
        if rb.stale():
            say("apply.py: a crashed rebase left state behind; starting over")
            rb.discard()
        else:
            raise UserError(
                f"a rebase of stack '{rb.state['stack']}' onto "
                f"{rb.state['onto']} is in progress: apply.py rebase "
                "--continue | --skip | --abort"
            )
    try:
        base = resolve_base(stack, onto, user_repo, rb.args.offline)
    except BaseUnavailable as e:
        raise UserError(f"base {onto} unavailable: {e.reason} ({e.hint})") from None
    wt = worktree(base.repo, f"{stack.name}-rebase", base.commit)
    old_base, old_head = old_stack(rb, stack, base.repo, user_repo)
    rb.state = {
        "series": str(rb.series.path),
        "stack": stack.name,
        "onto": onto,
        "base": dataclasses.asdict(base) | {"repo": str(base.repo)},
        "worktree": str(wt),
        "pid": os.getpid(),
        "phase": "running",
        "next": 0,
        "results": [],
        "staged": {},
        "old_base": old_base,
        "old_head": old_head,
        "as_stack": getattr(rb.args, "as_stack", None),
    }
    rb.save()
    return run(rb)


def old_stack(
    rb: Session, stack: Stack, repo: Path, user_repo: Path | None
) -> tuple[str | None, str | None]:
    """The old stack applied on its old base, for range-diff.

    The old base is obtained like any base (from its release wheel
    when it is not in the cache yet): besides the range-diff, its blobs
    are what git am's 3-way fallback needs to show a conflict as
    conflict markers rather than fail without a merge.
    """
    try:
        old = resolve_base(
            stack, None, user_repo, rb.args.offline, fetched_dir(rb.args)
        )
    except BaseUnavailable:
        return None, None
    if old.repo != repo:
        return None, None
    wt = worktree(repo, f"{stack.name}-rebase-old", old.commit)
    patches = [load_patch(rb.series, p) for p in stack.patches]
    res = {p.file: PatchResult(p.file) for p in patches}
    if apply_stack(wt, patches, res):
        return None, None
    return old.commit, gout("rev-parse", "HEAD", cwd=wt)


# run --------------------------------------------------------------------
def run(rb: Session) -> int:
    """Each patch from the state's next one; finish after the last."""
    st = rb.state
    stack = rb.series.stack(st["stack"])
    patches = [load_patch(rb.series, p) for p in stack.patches]
    wt = Path(st["worktree"])
    st["phase"], st["pid"] = "running", os.getpid()
    while st["next"] < len(patches):
        p = patches[st["next"]]
        pre = gout("rev-parse", "HEAD", cwd=wt)
        st["pre_head"] = pre
        rb.save()
        outcome, out = apply_patch(p, wt, pre)
        if outcome in ("clean", "3way"):
            rb.keep(p, wt, outcome)
        elif stops(rb, p, wt, outcome, out):
            return 1
    return finish(rb, stack)


def apply_patch(p: Patch, wt: Path, pre: str) -> tuple[str, str]:
    """git am one patch: clean, 3way, conflict or already-applied (git
    am's "No changes": exit 0 and no commit). Every kept patch made
    exactly one commit; otherwise the worktree is back at `pre`."""
    out = ""
    for outcome, three_way in (("clean", False), ("3way", True)):
        proc = am(wt, [p.path], three_way=three_way)
        out += (proc.stdout + proc.stderr).decode(errors="replace")
        made = commits_since(wt, pre)
        if proc.returncode == 0 and len(made) == 1:
            return outcome, out
        git_am(wt, "--abort")
        git("reset", "-q", "--hard", pre, cwd=wt)
        if proc.returncode == 0:
            return "already-applied", out
    return "conflict", out


def stops(rb: Session, p: Patch, wt: Path, outcome: str, out: str) -> bool:
    """A patch that does not apply, or that the base already holds: recorded
    not-needed when its regression tests pass without it; else the rebase
    stops there for a hand port (True)."""
    st = rb.state
    files = conflicted_files(wt, out, p) if outcome == "conflict" else []
    verdict, detail = regression(rb, p, wt, "new base without it")
    if verdict == "pass":
        why = (
            "the base already holds it word for word"
            if outcome == "already-applied"
            else "does not apply"
        )
        rb.record(
            p,
            "not-needed",
            f"{why}; its regression tests pass on {st['onto']} without it",
        )
        return False
    if outcome == "conflict":
        am(wt, [p.path], three_way=True)  # the conflict, for the user
    st.update(
        phase="stopped",
        conflict_files=files,
        conflict_detail=detail,
        verdict=verdict,
    )
    rb.save()
    print_stop(rb, p, files, verdict, detail)
    return True


def regression(rb: Session, p: Patch, wt: Path, label: str) -> tuple[str, str]:
    """The patch's regression verdict on `wt` (the new base with the patches
    kept before it, and the patch itself once resolved by hand), and one
    line on why."""
    res, _ = run_tests(
        rb.series.root,
        wt,
        p.regression,
        test_python(rb.args.python),
        f"{p.file} regression, {label}",
    )
    o = ran(aggregate([res[t] for t in p.regression]))
    detail = ", ".join(f"{t}: {res[t].verdict}" for t in p.regression)
    if o.reason and o.verdict != "pass":
        detail += f" ({o.reason})"
    return o.verdict, detail


def print_stop(
    rb: Session, p: Patch, files: list[str], verdict: str, detail: str
) -> None:
    wt = rb.state["worktree"]
    onto = rb.state["onto"]
    if verdict == "fail":
        why = f"its regression tests fail there without it ({detail})"
    else:
        why = (
            f"its regression tests cannot tell whether it is still needed "
            f"there ({verdict}: {detail})"
        )
    if files:
        print(f"CONFLICT: {p.file} does not apply to {onto}, and {why}.")
        print(f"  conflicting files (in {wt}):")
        for f in files:
            print(f"    {f}")
    else:
        print(f"STOPPED: {onto} already holds {p.file}, but {why}.")
    cmd = "python apply.py rebase"
    if rb.series.path != (PROJECT / "series").resolve():
        cmd += f" --series {shlex.quote(str(rb.series.path))}"
    print("  resolve them there, 'git add' them, then one of:")
    print(
        f"    {cmd} --continue   # commit the resolution (git am "
        "--continue), check it passes its regression tests, go on"
    )
    print("    (to reword it: git am --continue, git commit --amend, then --continue)")
    print(f"    {cmd} --skip       # drop this patch from the stack and go on")
    print(f"    {cmd} --abort      # stop; series and patches stay as they were")


# resume -----------------------------------------------------------------
def resume(rb: Session, how: str) -> int:
    """--continue, --skip or --abort a stopped rebase."""
    if not rb.load():
        raise UserError("no rebase in progress")
    st = rb.state
    wt = Path(st["worktree"])
    stack = rb.series.stack(st["stack"])
    in_am = (
        Path(gout("rev-parse", "--path-format=absolute", "--git-dir", cwd=wt))
        / "rebase-apply"
    ).exists()
    if how == "abort":
        if in_am:
            git_am(wt, "--abort")
        rb.discard()
        print(f"rebase of stack '{st['stack']}' aborted: series and patches unchanged")
        return 0
    if st.get("phase") != "stopped" and not rb.stale():
        raise UserError("the rebase is not stopped at a conflict")
    patches = [load_patch(rb.series, p) for p in stack.patches]
    p = patches[st["next"]]
    if how == "skip":
        skip(rb, p, wt, in_am)
    elif not resolved(rb, p, wt, in_am):
        return 1
    return run(rb)


def skip(rb: Session, p: Patch, wt: Path, in_am: bool) -> None:
    """--skip: the patch dropped from the stack, the worktree back where it
    stopped."""
    st = rb.state
    if in_am:
        git_am(wt, "--abort")
    git("reset", "-q", "--hard", st["pre_head"], cwd=wt)
    rb.record(
        p,
        "dropped",
        f"skipped by hand during the rebase onto {st['onto']} "
        f"(did not apply; regression tests without it: "
        f"{st.get('verdict', 'fail')})",
    )


def am_continue(wt: Path) -> None:
    """git am --continue, once every conflicted file is resolved."""
    unmerged = gout("diff", "--name-only", "--diff-filter=U", cwd=wt)
    if unmerged:
        raise UserError(
            f"still unresolved in {wt}: "
            f"{' '.join(unmerged.split())} (edit, git add, "
            "then --continue)"
        )
    proc = git_am(wt, "--continue")
    if proc.returncode != 0:
        err = (proc.stdout + proc.stderr).decode(errors="replace")
        last = (err.strip().splitlines() or ["?"])[-1]
        raise UserError(f"git am --continue failed in {wt}: {last}")


def resolved(rb: Session, p: Patch, wt: Path, in_am: bool) -> bool:
    """--continue: the hand resolution (committed by git am --continue when
    git am is still under way), one commit on top of where the patch
    stopped, kept if it passes the patch's regression tests."""
    if in_am:
        am_continue(wt)
    pre = rb.state["pre_head"]
    head = gout("rev-parse", "HEAD", cwd=wt)
    parent = gout("rev-parse", "HEAD^", cwd=wt, check=False)
    if parent != pre:
        raise UserError(
            f"expected exactly one commit on top of "
            f"{pre[:12]} in {wt} (found {head[:12]})"
        )
    verdict, detail = regression(rb, p, wt, "resolved by hand")
    if verdict != "pass":
        print(
            f"STOPPED: the resolution of {p.file} does not pass its "
            f"regression tests ({verdict}: {detail}).\n"
            f"  fix it in {wt} (amend the commit), then --continue again"
        )
        return False
    rb.keep(p, wt, "resolved")
    return True


# finish -----------------------------------------------------------------
def finish(rb: Session, stack: Stack) -> int:
    """The new patch files and series in place, a branch at the rebased
    stack, and what happened to each patch."""
    st = rb.state
    base = Base(**(st["base"] | {"repo": Path(st["base"]["repo"])}))
    head = gout("rev-parse", "HEAD", cwd=Path(st["worktree"]))
    name = st.get("as_stack") or stack.name
    branch = f"{REF_NS}/{name}/{ref_label(st['onto'])}"
    git("update-ref", branch, head, cwd=base.repo)
    records = [
        {
            "file": r["file"],
            "kind": r["outcome"],
            "base": st["onto"],
            "reason": r["reason"],
        }
        for r in st["results"]
        if r["outcome"] in RECORDS
    ]
    pins = new_pins(stack, base)
    into = st.get("as_stack")
    text = write_patches(rb.series, stack, pins, records, st["staged"], into)
    atomic_write(rb.series.path, text.encode())
    as_new = f" as new stack '{name}'" if into else ""
    print(
        f"rebased stack '{stack.name}' onto {st['onto']}{as_new} "
        f"({base.commit[:12]}): branch {branch}"
    )
    for r in st["results"]:
        why = f"  ({r['reason']})" if r.get("reason") else ""
        print(f"  {r['file']:<60} {r['outcome']}{why}")
    print_range_diff(st, base, head)
    rb.discard()
    return 0


def print_range_diff(st: dict, base: Base, head: str) -> None:
    """The old stack against the new one (git range-diff), when both are
    in the base's repository."""
    if not st["staged"]:
        print("\n(no patch of the stack is left to compare)")
    elif st.get("old_head"):
        rd = git(
            "range-diff",
            "--no-color",
            f"{st['old_base']}..{st['old_head']}",
            f"{base.commit}..{head}",
            cwd=base.repo,
            check=False,
        )
        print("\nrange-diff (old series vs new):")
        print(rd.stdout.decode(errors="replace").rstrip() or "  (no changes)")
    else:
        print("\n(range-diff skipped: the old base is not in this repository)")


# the command ------------------------------------------------------------
def cmd_rebase(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    rb = Session.of(series, args)
    for how in ("continue", "skip", "abort"):
        if getattr(args, how):
            return resume(rb, how)
    stack = series.stack(args.stack)
    user_repo = find_user_repo(args.repo)
    onto = args.onto
    if args.time_machine:
        onto = time_machine(series, stack, args.time_machine, user_repo, args)
        if onto is None:
            return 1
        if args.dry_run:
            return 0
    if not onto:
        raise UserError(
            "give --onto REV (or --time-machine A..B, --continue, --skip, --abort)"
        )
    check_new_stack(series, args.as_stack)
    return start(rb, stack, onto, user_repo)


def check_new_stack(series: Series, name: str | None) -> None:
    if name is None:
        return
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"--as {name}: not a valid stack name")
    if any(s.name == name for s in series.stacks):
        raise UserError(f"--as {name}: the series already has a stack '{name}'")
    if (series.patches_dir / name).exists():
        raise UserError(f"--as {name}: patches/{name} already exists")


def time_machine(
    series: Series,
    stack: Stack,
    rng: str,
    user_repo: Path | None,
    args: argparse.Namespace,
) -> str | None:
    """The newest base in the range where every patch applies (gbp pq's
    --time-machine): tried newest first, apply only."""
    for rev in reversed(parse_range(rng, user_repo, args.offline)):
        base, res, why = try_apply(series, stack, rev, user_repo, args, "tm")
        if base is None:
            print(f"  {rev}: base unavailable ({why})")
            continue
        bad = [f for f, r in res.items() if r.apply not in ("clean", "3way")]
        print(
            f"  {rev}: "
            + (
                "all patches apply"
                if not bad
                else f"{len(bad)} do not apply ({', '.join(bad)})"
            )
        )
        if not bad:
            print(f"time machine: newest base where the stack applies: {rev}")
            return rev
    print(f"time machine: no base in {rng} where every patch of '{stack.name}' applies")
    return None


def add_rebase_command(sub: argparse._SubParsersAction) -> None:
    r = command(
        sub,
        "rebase",
        cmd_rebase,
        help="carry a stack to a new base",
        description="Rebase a stack onto a new base: keep (and refresh) each "
        "patch that applies, mark 'not-needed' the ones that do not apply and "
        "whose regression tests pass without them, stop at real conflicts. "
        "series and patches/ change only when the whole rebase succeeds.",
        epilog="examples:\n  python apply.py rebase --onto v0.21.0\n"
        "  python apply.py rebase --continue    # after resolving a conflict\n"
        "  python apply.py rebase --time-machine v0.20.2..v0.26.0 --dry-run",
    )
    g = r.add_mutually_exclusive_group()
    g.add_argument("--onto", help="the new base (tag, commit, release)")
    g.add_argument(
        "--continue",
        action="store_true",
        dest="continue",
        help="go on after resolving a conflict",
    )
    g.add_argument(
        "--skip", action="store_true", help="drop the conflicting patch and go on"
    )
    g.add_argument(
        "--abort",
        action="store_true",
        help="stop; series and patches stay as they were",
    )
    g.add_argument(
        "--time-machine",
        metavar="A..B",
        help="rebase onto the newest base in A..B where all apply",
    )
    r.add_argument(
        "--as",
        dest="as_stack",
        metavar="NAME",
        help="carry the stack into a new stack NAME (patches/NAME/), keeping "
        "the rebased one for its base",
    )
    r.add_argument(
        "--dry-run", action="store_true", help="with --time-machine: only find the base"
    )
    common(r, "stack", "repo", "python", "offline", "fetched")
