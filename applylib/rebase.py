"""rebase (--continue/--skip/--abort, --time-machine) and status."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .bases import (
    RELEASE_TAG,
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
    command,
    common,
    format_patch,
    git,
    gout,
    rev_commit,
    say,
)
from .culprit import cmd_culprit
from .pinned import fetched_dir
from .runner import (
    PatchResult,
    am,
    apply_stack,
    commits_since,
    conflicted_files,
    git_am,
    judge,
    positions,
    ran,
    run_positions,
    table,
    test_plan,
    try_apply,
)
from .series import (
    Patch,
    Series,
    Stack,
    check_agreement,
    load_patch,
    parse_series,
    release_key,
    short_name,
)
from .testrun import aggregate, run_tests, test_python


def stack_directive(name: str, pins: dict[str, str]) -> str:
    order = ["repo", "tag", "branch", "commit", "upstream", "pypi", "fetch"]
    return " ".join(
        [f"#@ stack {name}"]
        + [f"{k}={shlex.quote(pins[k])}" for k in order if pins.get(k)]
    )


def record_line(rec: dict[str, str]) -> str:
    extra = "".join(
        f" {k}={shlex.quote(v)}"
        for k, v in rec.items()
        if k not in ("file", "kind") and not k.startswith("_")
    )
    return f"#@ {rec['kind']} {rec['file']}{extra}\n"


def rewrite_series(
    series: Series, stack: Stack, pins: dict[str, str], records: list[dict[str, str]]
) -> str:
    """The series text with the stack re-pinned and `records` taken out of
    its active list (kept as '#@ not-needed' / '#@ dropped' lines)."""
    lines = series.path.read_text().splitlines(keepends=True)
    gone = {stack.patch_lines[r["file"]] for r in records}
    last = max(
        [
            stack.lineno,
            *stack.patch_lines.values(),
            *(int(r.get("_line", 0)) for r in stack.not_needed),
        ]
    )
    out = []
    for n, line in enumerate(lines, 1):
        if n == stack.lineno:
            out.append(stack_directive(stack.name, pins) + "\n")
        elif n not in gone:
            out.append(line if line.endswith("\n") else line + "\n")
        if n == last:
            out += [record_line(r) for r in records]
    return "".join(out)


def add_stack(
    series: Series,
    stack: Stack,
    name: str,
    pins: dict[str, str],
    entries: list[str],
    records: list[dict[str, str]],
) -> str:
    """The series text with a new stack `name` after `stack`: the same
    patches carried to a new base (`entries`, under patches/<name>/), and
    `records` for those that did not come along; `stack` stays as it was."""
    lines = series.path.read_text().splitlines(keepends=True)
    last = max(
        [
            stack.lineno,
            *stack.patch_lines.values(),
            *(int(r.get("_line", 0)) for r in stack.not_needed),
        ]
    )
    block = [
        "\n",
        f"# The '{stack.name}' stack carried to "
        f"{pins.get('tag') or pins.get('commit')} by apply.py rebase.\n",
        stack_directive(name, pins) + "\n",
        *(e + "\n" for e in entries),
        *(record_line(r) for r in records),
    ]
    out = [ln if ln.endswith("\n") else ln + "\n" for ln in lines]
    return "".join(out[:last] + block + out[last:])


def new_pins(stack: Stack, base: Base) -> dict[str, str]:
    pins = {
        k: v
        for k, v in stack.pins.items()
        if k not in ("tag", "branch", "commit", "upstream", "fetch", "assemble")
    }
    if RELEASE_TAG.match(base.rev):
        pins["tag"] = base.rev if base.rev.startswith("v") else f"v{base.rev}"
    elif not re.fullmatch(r"[0-9a-f]{7,40}", base.rev):
        pins["branch"] = base.rev
    if base.source in ("repo", "remote"):
        pins["commit"] = base.commit
    elif base.upstream_commit:
        # a release materialized from its wheel: the wheel names the upstream
        # commit (often abbreviated); the full id is not known offline
        pins["upstream"] = base.upstream_commit
    return pins


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Rebase:
    """A rebase of one stack onto a new base, resumable after a conflict.

    Its state lives in the tool's cache (never in the project), and the new
    patch files are staged there too: the series and patches/ change only
    when the whole rebase has succeeded.
    """

    def __init__(self, series: Series, args: argparse.Namespace):
        self.series = series
        self.args = args
        key = hashlib.sha1(str(series.path).encode()).hexdigest()[:10]
        self.dir = cache_dir() / "rebase" / key
        self.file = self.dir / "state.json"
        self.state: dict = {}

    # state -------------------------------------------------------------
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

    # steps -------------------------------------------------------------
    def start(self, stack: Stack, onto: str, user_repo: Path | None) -> int:
        if self.load():
            if self.stale():
                say("apply.py: a crashed rebase left state behind; starting over")
                self.discard()
            else:
                raise UserError(
                    f"a rebase of stack '{self.state['stack']}' onto "
                    f"{self.state['onto']} is in progress: apply.py rebase "
                    "--continue | --skip | --abort"
                )
        try:
            base = resolve_base(stack, onto, user_repo, self.args.offline)
        except BaseUnavailable as e:
            raise UserError(f"base {onto} unavailable: {e.reason} ({e.hint})") from None
        wt = worktree(base.repo, f"{stack.name}-rebase", base.commit)
        old_base, old_head = self.old_stack(stack, base.repo, user_repo)
        self.state = {
            "series": str(self.series.path),
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
            "as_stack": getattr(self.args, "as_stack", None),
        }
        self.save()
        return self.run()

    def old_stack(
        self, stack: Stack, repo: Path, user_repo: Path | None
    ) -> tuple[str | None, str | None]:
        """The old stack applied on its old base, for range-diff.

        The old base is obtained like any base (from its release wheel
        when it is not in the cache yet): besides the range-diff, its blobs
        are what git am's 3-way fallback needs to show a conflict as
        conflict markers rather than fail without a merge.
        """
        try:
            old = resolve_base(
                stack, None, user_repo, self.args.offline, fetched_dir(self.args)
            )
        except BaseUnavailable:
            return None, None
        if old.repo != repo:
            return None, None
        wt = worktree(repo, f"{stack.name}-rebase-old", old.commit)
        patches = [load_patch(self.series, p) for p in stack.patches]
        res = {p.file: PatchResult(p.file) for p in patches}
        if apply_stack(wt, patches, res):
            return None, None
        return old.commit, gout("rev-parse", "HEAD", cwd=wt)

    def run(self) -> int:
        st = self.state
        stack = self.series.stack(st["stack"])
        patches = [load_patch(self.series, p) for p in stack.patches]
        wt = Path(st["worktree"])
        st["phase"], st["pid"] = "running", os.getpid()
        while st["next"] < len(patches):
            p = patches[st["next"]]
            pre = gout("rev-parse", "HEAD", cwd=wt)
            st["pre_head"] = pre
            self.save()
            outcome, out = self.apply(p, wt, pre)
            if outcome in ("clean", "3way"):
                self.keep(p, wt, outcome)
                continue
            files = conflicted_files(wt, out, p) if outcome == "conflict" else []
            verdict, detail = self.regression_without(p, wt)
            if verdict == "pass":
                why = (
                    "the base already holds it word for word"
                    if outcome == "already-applied"
                    else "does not apply"
                )
                self.record(
                    p,
                    "not-needed",
                    f"{why}; its regression tests pass on {st['onto']} without it",
                )
                continue
            if outcome == "conflict":
                am(wt, [p.path], three_way=True)  # the conflict, for the user
            st.update(
                phase="stopped",
                conflict_files=files,
                conflict_detail=detail,
                verdict=verdict,
            )
            self.save()
            self.print_stop(p, files, verdict, detail)
            return 1
        return self.finish(stack, patches)

    def apply(self, p: Patch, wt: Path, pre: str) -> tuple[str, str]:
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

    def regression_without(self, p: Patch, wt: Path) -> tuple[str, str]:
        """The patch's regression verdict on the new base (with the patches
        kept before it), and one line on why."""
        return self.regression(p, wt, "new base without it")

    def regression_with(self, p: Patch, wt: Path) -> tuple[str, str]:
        """The same on the hand-resolved commit: it must pass."""
        return self.regression(p, wt, "resolved by hand")

    def regression(self, p: Patch, wt: Path, label: str) -> tuple[str, str]:
        res, _ = run_tests(
            self.series.root,
            wt,
            p.regression,
            test_python(self.args.python),
            f"{p.file} regression, {label}",
        )
        o = ran(aggregate([res[t] for t in p.regression]))
        detail = ", ".join(f"{t}: {res[t].verdict}" for t in p.regression)
        if o.reason and o.verdict != "pass":
            detail += f" ({o.reason})"
        return o.verdict, detail

    def keep(self, p: Patch, wt: Path, outcome: str) -> None:
        st = self.state
        staged = self.dir / "staged" / p.file
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(format_patch(wt, "HEAD"))
        st["staged"][p.file] = str(staged)
        st["results"].append({"file": p.file, "outcome": outcome})
        st["next"] += 1
        self.save()

    def record(self, p: Patch, kind: str, reason: str) -> None:
        st = self.state
        st["results"].append({"file": p.file, "outcome": kind, "reason": reason})
        st["next"] += 1
        self.save()

    def print_stop(self, p: Patch, files: list[str], verdict: str, detail: str) -> None:
        wt = self.state["worktree"]
        onto = self.state["onto"]
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
        if self.series.path != (PROJECT / "series").resolve():
            cmd += f" --series {shlex.quote(str(self.series.path))}"
        print("  resolve them there, 'git add' them, then one of:")
        print(
            f"    {cmd} --continue   # commit the resolution (git am "
            "--continue), check it passes its regression tests, go on"
        )
        print(
            "    (to reword it: git am --continue, git commit --amend, then --continue)"
        )
        print(f"    {cmd} --skip       # drop this patch from the stack and go on")
        print(f"    {cmd} --abort      # stop; series and patches stay as they were")

    def resume(self, how: str) -> int:
        if not self.load():
            raise UserError("no rebase in progress")
        st = self.state
        wt = Path(st["worktree"])
        stack = self.series.stack(st["stack"])
        in_am = (
            Path(gout("rev-parse", "--path-format=absolute", "--git-dir", cwd=wt))
            / "rebase-apply"
        ).exists()
        if how == "abort":
            if in_am:
                git_am(wt, "--abort")
            self.discard()
            print(
                f"rebase of stack '{st['stack']}' aborted: series and patches unchanged"
            )
            return 0
        if st.get("phase") != "stopped" and not self.stale():
            raise UserError("the rebase is not stopped at a conflict")
        patches = [load_patch(self.series, p) for p in stack.patches]
        p = patches[st["next"]]
        if how == "skip":
            if in_am:
                git_am(wt, "--abort")
            git("reset", "-q", "--hard", st["pre_head"], cwd=wt)
            self.record(
                p,
                "dropped",
                f"skipped by hand during the rebase onto {st['onto']} "
                f"(did not apply; regression tests without it: "
                f"{st.get('verdict', 'fail')})",
            )
            return self.run()
        if in_am:
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
        head = gout("rev-parse", "HEAD", cwd=wt)
        parent = gout("rev-parse", "HEAD^", cwd=wt, check=False)
        if parent != st["pre_head"]:
            raise UserError(
                f"expected exactly one commit on top of "
                f"{st['pre_head'][:12]} in {wt} (found {head[:12]})"
            )
        verdict, detail = self.regression_with(p, wt)
        if verdict != "pass":
            print(
                f"STOPPED: the resolution of {p.file} does not pass its "
                f"regression tests ({verdict}: {detail}).\n"
                f"  fix it in {wt} (amend the commit), then --continue again"
            )
            return 1
        self.keep(p, wt, "resolved")
        return self.run()

    def write_patches(
        self, stack: Stack, pins: dict[str, str], records: list[dict[str, str]]
    ) -> str:
        """Put the staged patch files in place; the new series text. With
        --as NAME they go to patches/NAME/ and a new stack NAME is added,
        the rebased stack staying as it was."""
        st = self.state
        into = st.get("as_stack")
        entries = []
        for f, staged in st["staged"].items():
            dest = f"{into}/{Path(f).name}" if into else f
            entries.append(dest)
            path = self.series.patches_dir / dest
            data = Path(staged).read_bytes()
            if not path.exists() or data != path.read_bytes():
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, data)
        if into:
            return add_stack(self.series, stack, into, pins, entries, records)
        return rewrite_series(self.series, stack, pins, records)

    def finish(self, stack: Stack, patches: list[Patch]) -> int:
        st = self.state
        base = Base(**(st["base"] | {"repo": Path(st["base"]["repo"])}))
        wt = Path(st["worktree"])
        head = gout("rev-parse", "HEAD", cwd=wt)
        name = st.get("as_stack") or stack.name
        branch = f"{REF_NS}/{name}/{ref_label(st['onto'])}"
        git("update-ref", branch, head, cwd=base.repo)
        records = []
        for r in st["results"]:
            if r["outcome"] in RECORDS:
                records.append(
                    {
                        "file": r["file"],
                        "kind": r["outcome"],
                        "base": st["onto"],
                        "reason": r["reason"],
                    }
                )
        text = self.write_patches(stack, new_pins(stack, base), records)
        atomic_write(self.series.path, text.encode())
        into = f" as new stack '{name}'" if st.get("as_stack") else ""
        print(
            f"rebased stack '{stack.name}' onto {st['onto']}{into} "
            f"({base.commit[:12]}): branch {branch}"
        )
        for r in st["results"]:
            why = f"  ({r['reason']})" if r.get("reason") else ""
            print(f"  {r['file']:<60} {r['outcome']}{why}")
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
        self.discard()
        return 0


def cmd_rebase(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    rb = Rebase(series, args)
    for how in ("continue", "skip", "abort"):
        if getattr(args, how):
            return rb.resume(how)
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
    return rb.start(stack, onto, user_repo)


def check_new_stack(series: Series, name: str | None) -> None:
    if name is None:
        return
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"--as {name}: not a valid stack name")
    if any(s.name == name for s in series.stacks):
        raise UserError(f"--as {name}: the series already has a stack '{name}'")
    if (series.patches_dir / name).exists():
        raise UserError(f"--as {name}: patches/{name} already exists")


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def known_releases(user_repo: Path | None, offline: bool) -> tuple[set[str], bool]:
    """Final releases X.Y.Z that the package index lists (unless offline)
    and that the repos tag; and whether the index answered."""
    found: set[str] = set()
    answered = False
    if not offline:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "vllm"]
            + ["--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=False,
        )
        m = re.search(r"Available versions: (.*)", proc.stdout)
        if m:
            answered = True
            found |= {v.strip() for v in m.group(1).split(",")}
    for repo in (user_repo, cache_dir() / "vllm.git"):
        if repo is not None and repo.exists():
            found |= {
                t[1:]
                for t in gout("tag", "--list", "v*", cwd=repo, check=False).split()
            }
    return {v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v)}, answered


def list_releases(lo: str, hi: str, user_repo: Path | None, offline: bool) -> list[str]:
    """Final releases lo..hi (inclusive), oldest first, as vX.Y.Z."""
    found, _ = known_releases(user_repo, offline)
    want = [v for v in found if version_key(lo) <= version_key(v) <= version_key(hi)]
    if not want:
        raise UserError(
            f"no vLLM release between {lo} and {hi} (pip index "
            "unreachable and none cached?)"
        )
    return [f"v{v}" for v in sorted(want, key=version_key)]


def parse_range(text: str, user_repo: Path | None, offline: bool) -> list[str]:
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise UserError(f"range '{text}' is not A..B")
    if RELEASE_TAG.match(lo) and RELEASE_TAG.match(hi):
        return list_releases(lo.lstrip("v"), hi.lstrip("v"), user_repo, offline)
    if user_repo is None:
        raise UserError(
            "a commit range needs --repo (release ranges vA..vB work without one)"
        )
    commits = gout(
        "rev-list",
        "--first-parent",
        "--reverse",
        f"{lo}..{hi}",
        cwd=user_repo,
        check=False,
    ).split()
    if not commits:
        raise UserError(f"empty or unknown range '{text}' in {user_repo}")
    return commits


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


def status_column(
    series: Series,
    stack: Stack,
    rev: str,
    user_repo: Path | None,
    args: argparse.Namespace,
) -> dict:
    """One base of the matrix: the stack applied, and each patch's
    regression tests at its own position (the base plus the patches before
    it that apply there)."""
    say(f"apply.py status: {stack.name} on {rev}")
    base, res, why = try_apply(series, stack, rev, user_repo, args, "status")
    col: dict = {"base": rev, "cells": {}}
    if base is None:
        col["unavailable"] = why
        return col
    col.update(commit=base.commit, upstream_commit=base.upstream_commit)
    patches = [load_patch(series, p) for p in stack.patches]
    commits = positions(base.commit, patches, res)
    plan = test_plan(patches, res, full=False)
    outs, _ = run_positions(
        series,
        base.repo,
        f"{stack.name}-status-at",
        commits,
        plan,
        test_python(args.python),
    )
    judge(patches, res, outs, full=False)
    for p in patches:
        r = res[p.file]
        cell = {"apply": r.apply, "regression_base": r.regression_base}
        if r.reasons.get("regression_base"):
            cell["reason"] = r.reasons["regression_base"]
        if r.apply in ("clean", "3way") and r.regression_base == "pass":
            cell["note"] = "applies, but its regression tests pass without it"
        col["cells"][p.file] = cell
    return col


def print_matrix(patches: list[Patch], columns: list[dict]) -> None:
    """One row per base (releases grow downwards), one column per patch; a
    cell is the apply outcome and, after '/', the regression verdict at the
    patch's position."""
    short = {p.file: short_name(p.file) for p in patches}
    rows = [tuple(["base", "upstream"] + [short[p.file] for p in patches])]
    reasons = []
    for c in columns:
        row = [c["base"], (c.get("upstream_commit") or "")[:9]]
        for p in patches:
            if "unavailable" in c:
                row.append("unavailable")
                continue
            cell = c["cells"][p.file]
            mark = "*" if cell.get("note") else ""
            row.append(f"{cell['apply']}/{cell['regression_base']}{mark}")
            if cell["regression_base"] in ("error", "skip"):
                reasons.append(f"  {c['base']} {short[p.file]}: {cell.get('reason')}")
        rows.append(tuple(row))
    for line in table(rows):
        print(line)
    print("cell: apply outcome / regression verdict without the patch (fail: the")
    print("bug is there; pass: it is not; error: cannot tell, reason below);")
    print("*: applies although its regression tests pass without it")
    for p in patches:
        print(f"  {short[p.file]}: {p.file}")
    if reasons:
        print("cannot tell:")
        print("\n".join(reasons))


def cmd_status(args: argparse.Namespace) -> int:
    if args.installed:
        if args.bases or args.releases or args.commits or args.culprit:
            raise UserError(
                "--installed takes no --bases, --releases, --commits or --culprit"
            )
        from .installed import cmd_installed

        return cmd_installed(args)
    if args.test_python or args.no_tests:
        raise UserError("--test-python and --no-tests go with --installed")
    series = parse_series(Path(args.series))
    check_agreement(series)
    user_repo = find_user_repo(args.repo)
    if args.newer:
        if args.bases or args.releases or args.commits or args.culprit:
            raise UserError(
                "--newer takes no --bases, --releases, --commits, --culprit"
            )
        return cmd_newer(series, user_repo, args)
    stack = series.stack(args.stack)
    if sum(map(bool, (args.bases, args.releases, args.commits))) != 1:
        raise UserError(
            "give one of --installed, --bases A,B,..., --releases A..B or "
            "--commits A..B (with --repo)"
        )
    if args.commits:
        revs = commit_range(args.commits, user_repo)
    elif args.bases:
        revs = args.bases.split(",")
    else:
        revs = parse_range(args.releases, user_repo, args.offline)
    if args.culprit:
        return cmd_culprit(series, stack, revs, user_repo, args)
    columns = [status_column(series, stack, rev, user_repo, args) for rev in revs]
    print_matrix([load_patch(series, p) for p in stack.patches], columns)
    report = {
        "stack": stack.name,
        "date": time.strftime("%Y-%m-%d"),
        "columns": columns,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return 0


def newest_stack(series: Series, name: str | None) -> Stack:
    """--stack NAME, else the stack pinned to the newest release."""
    if name:
        return series.stack(name)
    released = [s for s in series.stacks if release_key(s.pins.get("tag", ""))]
    if not released:
        raise UserError("no stack of the series is pinned to a release tag")
    return max(released, key=lambda s: release_key(s.pins["tag"]))


def next_step(column: dict, file: str) -> str:
    """What a maintainer does with one patch on a new release."""
    if "unavailable" in column:
        return f"base unavailable ({column['unavailable']})"
    cell = column["cells"][file]
    apply, verdict = cell["apply"], cell["regression_base"]
    if apply == "not-needed":
        return "absorbed upstream (its regression tests pass there): drops"
    if verdict == "pass":
        return f"{apply}, but its regression tests pass without it: check why"
    if verdict != "fail":
        return f"{apply}; its tests cannot tell ({verdict}): port the tests"
    if apply == "conflict":
        return "conflicts and the bug is there: port it by hand"
    return f"applies ({apply}) and the bug is there: carry it"


def cmd_newer(series: Series, user_repo: Path | None, args: argparse.Namespace) -> int:
    """Keeping up: the releases newer than the newest stack's pin, the status
    of that stack on each, and what to do on the newest."""
    stack = newest_stack(series, args.stack)
    pin = stack.pins.get("tag", "")
    if not release_key(pin):
        raise UserError(f"stack '{stack.name}' is not pinned to a release tag")
    found, answered = known_releases(user_repo, args.offline)
    newer = sorted(
        (v for v in found if version_key(v) > version_key(pin[1:])), key=version_key
    )
    where = "the package index" if answered else "cached tags only (index not reached)"
    if not newer:
        print(
            f"up to date: no vLLM release newer than {pin} (stack {stack.name}; {where})"
        )
        return 0
    revs = [f"v{v}" for v in newer]
    print(f"newer than {pin} (stack {stack.name}; {where}): {', '.join(revs)}")
    columns = [status_column(series, stack, rev, user_repo, args) for rev in revs]
    patches = [load_patch(series, p) for p in stack.patches]
    print_matrix(patches, columns)
    print(f"on {revs[-1]}:")
    for p in patches:
        print(f"  {short_name(p.file)}: {next_step(columns[-1], p.file)}")
    print(
        f"next: python apply.py rebase --onto {revs[-1]} --stack {stack.name}"
        f" --as {stack.name.split('-v')[0]}-{revs[-1].rsplit('.', 1)[0]}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"stack": stack.name, "pin": pin, "newer": revs, "columns": columns}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1


STATUS_HELP = """\
Three questions about the series and vLLM versions.

--bases / --releases / --commits: a patch x base matrix. For each base,
apply the stack and run each patch's regression tests at its position on
the unpatched base: clean / 3way / conflict / not-needed per patch, every
cell measured.

--culprit (with one of those): per patch, the first base where it stops
applying, and the first where its bug is absorbed upstream (its
regression verdict turns from fail to pass), found by bisection (git
bisect style: one change assumed per range; a base where the tests cannot
tell, an error, is skipped and a neighbour probed). With --commits and
--repo the answer is a commit of a real vLLM clone, with its subject.

--installed: the vLLM installed in a Python environment (--python PY;
default: the Python running apply.py when vLLM is installed there, else
$VLLM_PATCHES_PYTHON): its version and upstream commit; per patch of the
stack pinned to that release (or --stack NAME[,NAME] / all):
  in effect   every installed file the patch changes has the patched
              tree's content (the whole stack applied on that release;
              a file two patches change holds both or neither),
  absent      every one has the release's content,
  modified    neither: the files are named;
and, by running its regression tests against the installed package, the
bug: present (fail), absent (pass), or cannot tell (error, with why).
Hashes come from the patched wheel's .dist-info/vllm_patches.json when
apply.py wheel made it from this series, else from the stack applied on
the release's base. The regression tests run in place when the inspected
Python has pytest, else by the test Python (--test-python, default
$VLLM_PATCHES_PYTHON or ./.venv) importing only the installed vllm
package from that environment (the serving environment's own torch is
then not the one tested). Nothing is written into that environment
(bytecode writing is off for everything that imports from it). Exit 0:
every needed patch in effect and no bug present (a patch that does not
apply on the installed release and whose regression tests pass there is
not needed); 1: otherwise; 2: bad input.
"""

STATUS_EPILOG = """\
examples:
  python apply.py status --bases v0.20.2,v0.21.0
  python apply.py status --releases v0.20.0..v0.33.0 --json m.json
  python apply.py status --releases v0.20.0..v0.33.0 --stack tq --culprit
  python apply.py status --newer      # keeping up: a release past the newest pin?
  python apply.py status --commits v0.20.2..v0.21.0 --repo ~/src/vllm --culprit
  /srv/venv/bin/python apply.py status --installed
  python apply.py status --installed --python /srv/venv/bin/python --json s.json
"""


def commit_range(text: str, user_repo: Path | None) -> list[str]:
    """A..B in --repo: A, then the first-parent commits after it up to B."""
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise UserError(f"range '{text}' is not A..B")
    if user_repo is None:
        raise UserError("--commits needs --repo (a vLLM git clone)")
    start = rev_commit(user_repo, lo)
    if start is None or rev_commit(user_repo, hi) is None:
        raise UserError(f"unknown revision in '{text}' in {user_repo}")
    return [start] + parse_range(f"{start}..{hi}", user_repo, True)


def add_rebase_commands(sub: argparse._SubParsersAction) -> None:
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
    add_status_command(sub)


def add_status_command(sub: argparse._SubParsersAction) -> None:
    s = command(
        sub,
        "status",
        cmd_status,
        help="patch x base matrix; culprit search; an installed vLLM",
        description=STATUS_HELP,
        epilog=STATUS_EPILOG,
    )
    s.add_argument("--bases", help="comma-separated revisions")
    s.add_argument("--releases", metavar="A..B", help="every release in A..B")
    s.add_argument(
        "--commits",
        metavar="A..B",
        help="the first-parent commits of --repo from A (included) to B",
    )
    s.add_argument(
        "--culprit",
        action="store_true",
        help="per patch, bisect the bases for where it stops applying and "
        "where its bug is absorbed upstream",
    )
    s.add_argument(
        "--max-skips",
        type=int,
        default=4,
        metavar="N",
        help="with --culprit: stop a search after N bases that cannot tell "
        "(default 4; a negative number: never)",
    )
    s.add_argument(
        "--newer",
        action="store_true",
        help="is there a release newer than the newest stack's pin, and what "
        "does the series need there (exit 1 when there is)",
    )
    s.add_argument(
        "--installed",
        action="store_true",
        help="check the vLLM installed in --python's environment",
    )
    s.add_argument(
        "--test-python",
        metavar="PY",
        help="with --installed: the Python that runs the regression tests "
        "(default: the inspected one if it has pytest, else $VLLM_PATCHES_PYTHON, "
        "./.venv)",
    )
    s.add_argument(
        "--no-tests",
        action="store_true",
        help="with --installed: files and imports only",
    )
    s.add_argument("--json", help="write the report here")
    common(
        s,
        "python",
        helps={
            "python": "Python that runs the tests; with --installed: the "
            "environment inspected"
        },
    )
    common(s, "stack", "repo", "offline", "fetched")
