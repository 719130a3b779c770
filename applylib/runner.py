"""Applying a stack with git am, running targeted tests, the main job."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bases import (
    BaseUnavailable,
    find_user_repo,
    locked,
    ref_label,
    with_pinned_base,
    worktree,
)
from .core import AM_CONFIG, PROJECT, REF_NS, UserError, git, git_common_dir, gout, say
from .series import Patch, Series, Stack, check_agreement, load_patch, parse_series


@dataclasses.dataclass
class PatchResult:
    file: str
    apply: str = "skipped"  # clean | 3way | conflict | not-needed | skipped
    regression_base: str = "skip"
    regression_patched: str = "skip"
    tests: str = "skip"
    seconds: float = 0.0
    conflict_files: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    test_outcomes: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def ok(self) -> bool:
        if self.apply == "not-needed":
            return True
        return (
            self.apply in ("clean", "3way")
            and self.regression_base == "fail"
            and self.regression_patched == "pass"
            and self.tests in ("pass", "skip")
        )

    def to_json(self) -> dict:
        d = {
            "file": self.file,
            "apply": self.apply,
            "regression": {
                "base": self.regression_base,
                "patched": self.regression_patched,
            },
            "tests": self.tests,
            "seconds": round(self.seconds, 2),
        }
        if self.conflict_files:
            d["conflict_files"] = self.conflict_files
        if self.detail:
            d["detail"] = self.detail
        if self.test_outcomes:
            d["test_outcomes"] = self.test_outcomes
        return d


def am(wt: Path, patches: list[Path], three_way: bool) -> subprocess.CompletedProcess:
    return git(
        "am",
        "-q",
        "-k",
        "--committer-date-is-author-date",
        "--3way" if three_way else "--no-3way",
        *map(str, patches),
        cwd=wt,
        check=False,
        config=AM_CONFIG,
    )


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


def apply_stack(
    wt: Path, patches: list[Patch], results: dict[str, PatchResult]
) -> list[Patch]:
    """git am the patches in order; returns those that stopped on a conflict.

    The whole stack goes through one git am, as fast as plain git am. A patch
    that does not apply as is is retried alone with the 3-way fallback.
    Conflicting patches are left out (their later patches still tried).
    """
    todo = list(patches)
    conflicts: list[Patch] = []
    while todo:
        start = gout("rev-parse", "HEAD", cwd=wt)
        t0 = time.monotonic()
        proc = am(wt, [p.path for p in todo], three_way=False)
        n = len(gout("rev-list", f"{start}..HEAD", cwd=wt).split())
        dt = (time.monotonic() - t0) / max(1, n + (proc.returncode != 0))
        for p in todo[:n]:
            results[p.file].apply = "clean"
            results[p.file].seconds += dt
        if proc.returncode == 0:
            break
        git("am", "--quit", cwd=wt, check=False)
        git("reset", "-q", "--hard", "HEAD", cwd=wt)
        stuck = todo[n]
        todo = todo[n + 1 :]
        t0 = time.monotonic()
        proc3 = am(wt, [stuck.path], three_way=True)
        res = results[stuck.file]
        res.seconds += time.monotonic() - t0
        if proc3.returncode == 0:
            res.apply = "3way"
            continue
        out = (proc.stdout + proc.stderr + proc3.stdout + proc3.stderr).decode(
            errors="replace"
        )
        res.apply = "conflict"
        res.conflict_files = conflicted_files(wt, out, stuck)
        res.detail = "; ".join(
            ln for ln in out.splitlines() if ln.startswith("error:")
        )[:500]
        git("am", "--abort", cwd=wt, check=False)
        conflicts.append(stuck)
    return conflicts


def test_python(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("VLLM_PATCHES_PYTHON"):
        return os.environ["VLLM_PATCHES_PYTHON"]
    venv = PROJECT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


SELECT_PLUGIN = """\
# Written by apply.py: keep only the requested node ids. Passing node ids to
# pytest directly would stop the whole run at the first one that cannot be
# collected (an import error on a base, say); this way that module reports an
# error and every other test still runs.
import os


def pytest_collection_modifyitems(config, items):
    want = os.environ["VLLM_PATCHES_SELECT"].split("\\n")

    def keep(nid):
        return any(nid == w or nid.startswith((w + "::", w + "[")) for w in want)

    gone = [i for i in items if not keep(i.nodeid)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if keep(i.nodeid)]
"""


def run_tests(
    root: Path, tree: Path, node_ids: list[str], python: str, label: str
) -> tuple[dict[str, tuple[str, float]], str]:
    """Run pytest on node ids against a tree; outcome and seconds per id."""
    if not node_ids:
        return {}, ""
    # a missing file would stop pytest before it runs anything: leave it out,
    # and its node ids come out as errors
    files = [
        f
        for f in dict.fromkeys(n.split("::", 1)[0] for n in node_ids)
        if (root / f).exists()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        (Path(tmp) / "vllm_patches_select.py").write_text(SELECT_PLUGIN)
        pypath = os.pathsep.join(
            x for x in (tmp, os.environ.get("PYTHONPATH", "")) if x
        )
        env = dict(
            os.environ,
            VLLM_TREE=str(tree),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=pypath,
            VLLM_PATCHES_SELECT="\n".join(node_ids),
        )
        cmd = [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "vllm_patches_select",
            f"--rootdir={root}",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={xml}",
            "--continue-on-collection-errors",
            *files,
        ]
        say(f"apply.py: pytest ({label}): {len(node_ids)} node id(s)")
        timeout = float(os.environ.get("VLLM_PATCHES_TEST_TIMEOUT", "3600"))
        try:
            proc = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
            )
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            output = f"pytest timed out after {timeout:.0f} s\n{e.stdout or ''}"
        except OSError as e:
            raise UserError(f"cannot run the test Python '{python}': {e}") from None
        cases = parse_junit(xml) if xml.exists() else []
    out: dict[str, tuple[str, float]] = {}
    for nid in node_ids:
        mine = [(o, s) for cid, o, s in cases if covers(nid, cid)]
        outs = {o for o, _ in mine}
        secs = sum(s for _, s in mine)
        if not outs or "error" in outs:
            out[nid] = ("error", secs)
        elif "fail" in outs:
            out[nid] = ("fail", secs)
        elif outs == {"skip"}:
            out[nid] = ("skip", secs)
        else:
            out[nid] = ("pass", secs)
    return out, output


def covers(requested: str, case: str) -> bool:
    if case == requested:
        return True
    if case.startswith(requested + "::") or case.startswith(requested + "["):
        return True
    # a collection error is reported against the module
    return "::" not in case and requested.split("::")[0] == case


def parse_junit(xml: Path) -> list[tuple[str, str, float]]:
    """(node id, outcome, seconds) per test case of a pytest xunit1 report."""
    import xml.etree.ElementTree as ET

    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        f, cls, name = (tc.get(k) or "" for k in ("file", "classname", "name"))
        if not cls:  # a collection error: the name is the module's dotted path
            cid = f or name.replace(".", "/") + ".py"
        else:
            module = f[:-3].replace("/", ".") if f.endswith(".py") else f
            klass = cls[len(module) + 1 :] if cls.startswith(module + ".") else ""
            cid = "::".join(x for x in (f, klass, name) if x)
        if tc.find("failure") is not None:
            o = "fail"
        elif tc.find("error") is not None:
            o = "error"
        elif tc.find("skipped") is not None:
            o = "skip"
        else:
            o = "pass"
        cases.append((cid, o, float(tc.get("time") or 0.0)))
    return cases


def aggregate(outcomes: list[str], want_fail: bool) -> str:
    """One word for a set of test outcomes.

    Regression tests on the base (want_fail): "fail" only when every one of
    them fails, "pass" only when every one passes; a mix, or an error, is
    "error" (the per-test outcomes are in the report). Elsewhere: any error
    is "error", else any failure "fail", else "pass" ("skip" if all skipped).
    """
    s = set(outcomes)
    if not s or s == {"skip"}:
        return "skip"
    if want_fail:
        return s.pop() if s in ({"fail"}, {"pass"}) else "error"
    if "error" in s:
        return "error"
    return "fail" if "fail" in s else "pass"


def run_stack(
    series: Series,
    stack: Stack,
    patches: list[Patch],
    rev: str | None,
    user_repo: Path | None,
    args: argparse.Namespace,
) -> dict:
    t_stack = time.monotonic()
    rep: dict = {
        "name": stack.name,
        "pins": stack.pins,
        "base": rev or stack.pins.get("tag") or stack.pins.get("commit"),
    }
    try:
        base = with_pinned_base(stack, rev, user_repo, args.offline)
    except BaseUnavailable as e:
        rep.update(
            status="skipped",
            reason=e.reason,
            fetch=e.hint,
            patches=[PatchResult(p).to_json() for p in stack.patches],
        )
        return rep
    rep.update(
        base=base.rev, base_commit=base.commit, source=base.source, repo=str(base.repo)
    )
    if base.upstream_commit:
        rep["upstream_commit"] = base.upstream_commit
    results = {p.file: PatchResult(p.file) for p in patches}
    label = ref_label(base.rev)
    with locked(hashlib.sha1(str(git_common_dir(base.repo)).encode()).hexdigest()[:10]):
        wt = worktree(base.repo, f"{stack.name}-patched", base.commit)
        conflicts = apply_stack(wt, patches, results)
        head = gout("rev-parse", "HEAD", cwd=wt)
        branch = f"{REF_NS}/{stack.name}/{label}"
        git("update-ref", branch, head, cwd=base.repo)
        rep.update(branch=branch, head=head, worktree=str(wt))
        if not args.no_tests:
            base_wt = worktree(base.repo, f"{stack.name}-base", base.commit)
            python = test_python(args.python)
            reg_ids: list[str] = []
            for p in patches:
                reg_ids += [t for t in p.regression if t not in reg_ids]
            on_base, log_base = run_tests(
                series.root, base_wt, reg_ids, python, f"{stack.name}, unpatched base"
            )
            applied = [p for p in patches if results[p.file].apply in ("clean", "3way")]
            all_ids: list[str] = []
            for p in applied:
                all_ids += [t for t in p.tests if t not in all_ids]
            on_patched, log_patched = run_tests(
                series.root, wt, all_ids, python, f"{stack.name}, patched"
            )
            for p in patches:
                r = results[p.file]
                r.regression_base = aggregate(
                    [on_base[t][0] for t in p.regression if t in on_base], True
                )
                r.seconds += sum(on_base[t][1] for t in p.regression if t in on_base)
                r.test_outcomes["base"] = {
                    t: on_base[t][0] for t in p.regression if t in on_base
                }
                if p in conflicts and r.regression_base == "pass":
                    r.apply = "not-needed"
                    r.detail = (
                        "does not apply, and its regression tests pass "
                        "on the unpatched base"
                    )
                if r.apply not in ("clean", "3way"):
                    continue
                r.regression_patched = aggregate(
                    [on_patched[t][0] for t in p.regression], False
                )
                rest = [t for t in p.tests if t not in p.regression]
                r.tests = aggregate([on_patched[t][0] for t in p.tests], False)
                r.seconds += sum(on_patched[t][1] for t in rest)
                r.seconds += sum(on_patched[t][1] for t in p.regression)
                r.test_outcomes["patched"] = {t: on_patched[t][0] for t in p.tests}
            rep["logs"] = {"base": log_base[-20000:], "patched": log_patched[-20000:]}
    rep["status"] = "ran"
    rep["patches"] = [results[p.file].to_json() for p in patches]
    rep["ok"] = (
        all(results[p.file].ok() for p in patches)
        if not args.no_tests
        else all(results[p.file].apply in ("clean", "3way") for p in patches)
    )
    rep["seconds"] = round(time.monotonic() - t_stack, 2)
    return rep


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
        src = st["source"]
        up = f", upstream {st['upstream_commit']}" if st.get("upstream_commit") else ""
        print(
            f"== stack {st['name']} on {st['base']} ({st['base_commit'][:12]}, "
            f"from {src}{up})"
        )
        rows = [("patch", "apply", "regr. base", "regr. patched", "tests", "secs")]
        for p in st["patches"]:
            rows.append(
                (
                    p["file"],
                    p["apply"],
                    p["regression"]["base"],
                    p["regression"]["patched"],
                    p["tests"],
                    f"{p['seconds']:.1f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for i, r in enumerate(rows):
            print(
                "  "
                + "  ".join(
                    c.ljust(w) for c, w in zip(r, widths, strict=False)
                ).rstrip()
            )
            if i == 0:
                print("  " + "  ".join("-" * w for w in widths))
        for p in st["patches"]:
            if p.get("conflict_files"):
                print(f"  {p['file']}: conflicts in {', '.join(p['conflict_files'])}")
        print(
            f"  result: {'OK' if st['ok'] else 'FAILED'}; patched tree: "
            f"{st['branch']} in {st['repo']}"
        )
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
    if args.base and not args.stack and len(series.stacks) > 1:
        say(
            f"apply.py: --base without --stack: using the first stack, "
            f"'{series.stacks[0].name}'"
        )
    stacks = [series.stack(args.stack)] if (args.stack or args.base) else series.stacks
    report = {"tool": "apply.py", "series": str(series.path), "stacks": []}
    for st in stacks:
        report["stacks"].append(
            run_stack(
                series, st, [loaded[p] for p in st.patches], args.base, user_repo, args
            )
        )
    ran = [s for s in report["stacks"] if s["status"] == "ran"]
    failed = [s for s in ran if not s["ok"]]
    skipped = [s for s in report["stacks"] if s["status"] == "skipped"]
    code = 1 if failed or (args.require_all and skipped) or not ran else 0
    report["exit_code"] = code
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return code
