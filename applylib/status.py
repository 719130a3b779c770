"""status: a patch x base matrix, keeping up with new releases (--newer),
the culprit search (culprit.py) and an installed vLLM (installed.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .bases import find_user_repo
from .core import UserError, command, common, say
from .culprit import cmd_culprit
from .ranges import commit_range, known_releases, parse_range, version_key
from .runner import judge, positions, run_positions, table, test_plan, try_apply
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
from .testrun import test_python


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
$VLLM_PATCHES_PYTHON or the project's .venv) importing only the installed vllm
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
        "the project's .venv)",
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
