"""A PR's regression tests as vLLM's CI would run them: plain pytest in
vLLM's own tree layout, with none of this project's harness (the exported
test modules carry what they need), on the PR's parent with the PR's test
files copied in, and on the PR's tree."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .bases import worktree
from .core import gout
from .testrun import tree_env

OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+)")
SKIPPED = re.compile(r"^SKIPPED \[\d+\] ([^:\s]+)(?::\d+)?: (.*)$")
# The host, the same for every tree. CPU-only: Triton kernels run in
# Triton's interpreter (vLLM turns Triton off without a GPU driver
# otherwise), and vLLM's conftest's emptying of the accelerator's caches
# after each test, which raises where there is none, does nothing. A GPU
# with a source tree (no compiled extensions to load): vLLM's CpuPlatform
# stands in as the platform, the tensors and Triton kernels on the GPU.
HOST_PLUGIN = """\
import importlib.util
import os
from pathlib import Path

import torch

if not torch.accelerator.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.accelerator.empty_cache = lambda: None
    torch.accelerator.empty_host_cache = lambda: None
elif not list(Path(importlib.util.find_spec("vllm").origin).parent.glob("_C*.so")):
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
"""


def run_plain(
    tree: Path, args: list[str], python: str, plugin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m pytest -q -rA ARGS` in `tree`, the tree importable as an
    installed vLLM is (tree_env's metadata), none of the harness's
    variables; `plugin`, a module's text, loaded with -p."""
    with tempfile.TemporaryDirectory(prefix="vllm-patches-plain-") as scratch:
        env = dict(os.environ, **tree_env(tree, Path(scratch)))
        for own in ("VLLM_TREE", "VLLM_PATCHES_TREE_ENV"):  # the harness's
            env.pop(own, None)
        cmd = [python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]
        if plugin is not None:
            (Path(scratch) / "vllm_patches_plugin.py").write_text(plugin)
            env["PYTHONPATH"] += os.pathsep + scratch
            cmd += ["-p", "vllm_patches_plugin"]
        return subprocess.run(
            cmd + args, cwd=tree, env=env, capture_output=True, text=True, check=False
        )


def plain_pytest(tree: Path, ids: list[str], python: str) -> dict[str, str]:
    """Each test id's outcome (`outcome`) under plain pytest in `tree`, on
    this host (HOST_PLUGIN); "skipped (REASON)" for one that its file's skip
    left unrun here."""
    p = run_plain(tree, ids, python, HOST_PLUGIN)
    seen, skipped = {}, {}
    for line in p.stdout.splitlines():
        if m := OUTCOME.match(line):
            seen[m.group(2)] = m.group(1).lower()
        elif m := SKIPPED.match(line):
            skipped.setdefault(m.group(1), m.group(2))
    got = {t: outcome(t, seen) for t in ids}
    for t in ids:
        why = skipped.get(t.split("::")[0])
        if got[t] == "not run" and why:
            got[t] = f"skipped ({why})"
    return got


def outcome(test: str, seen: dict[str, str]) -> str:
    """A test id's outcome from pytest's reported ones: its own, or, for a
    parametrized test named without parameters or a test file, failed (or
    error) when one of its cases is, passed when all are; "not run" when
    none reported."""
    got = [
        o
        for k, o in seen.items()
        if k == test or k.startswith((test + "[", test + "::"))
    ]
    for bad in ("error", "failed"):
        if bad in got:
            return bad
    return got[0] if got and len(set(got)) == 1 else "not run"


@dataclasses.dataclass(frozen=True)
class Proof:
    """Regression tests under plain pytest in vLLM's tree: the Markdown
    table of their outcomes, whether they prove the change (failed before
    and passed with it, or failed without the fix), and whether one was
    skipped on this host (nothing proven either way)."""

    table: str
    ok: bool
    skipped: bool


def before_and_with(
    repo: Path,
    key: str,
    before: str,
    after: Path,
    ids: list[str],
    python: str,
    change: str = "with this change",
) -> Proof:
    """The tests `ids` under plain pytest on commit `before` (with the test
    files `after`'s index adds under tests/ copied in) and in the worktree
    `after`."""
    added = gout(
        "diff",
        "--cached",
        "--name-only",
        "--diff-filter=A",
        before,
        "--",
        "tests",
        cwd=after,
    ).split()
    wt = worktree(repo, f"{key}-plain-before", before)
    for f in added:
        (wt / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(after / f, wt / f)
    was, now = plain_pytest(wt, ids, python), plain_pytest(after, ids, python)
    rows = [f"| `{t}` | {was[t]} | {now[t]} |" for t in ids]
    table = [
        (
            "The regression tests under plain pytest in vLLM's tree, before "
            f"and {change}:"
        ),
        "",
        f"| test | before | {change} |",
        "|---|---|---|",
        *rows,
    ]
    return Proof(
        "\n".join(table),
        all(was[t] == "failed" and now[t] == "passed" for t in ids),
        _skipped(was, now),
    )


def fail_without_fix(tree: Path, ids: list[str], python: str) -> Proof:
    """The tests `ids` under plain pytest in `tree`, which holds them but
    not the fix they were written for: proven when each failed (the bug is
    there)."""
    was = plain_pytest(tree, ids, python)
    rows = [f"| `{t}` | {was[t]} |" for t in ids]
    table = [
        "The regression tests under plain pytest in vLLM's tree, without the fix:",
        "",
        "| test | without the fix |",
        "|---|---|",
        *rows,
    ]
    return Proof("\n".join(table), all(was[t] == "failed" for t in ids), _skipped(was))


def _skipped(*runs: dict[str, str]) -> bool:
    return any(o.startswith("skipped") for run in runs for o in run.values())
