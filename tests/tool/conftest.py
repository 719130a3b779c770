"""Fixtures for the tests of apply.py: fixture git repositories and projects.

Each test gets an "upstream" vLLM-like repository (a few small files, release
tags v1.0.0 and v1.1.0) and a project directory (series, patches/, tests/)
whose patches are made by committing fixes in a scratch clone and exporting
them with apply.py's own deterministic format-patch. apply.py runs as a user
runs it: a subprocess, with its cache in the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "apply.py"

MOD_V1 = '''\
def threshold():
    return 128


def add(a, b):
    return a - b  # bug: subtraction


def scale(x):
    return x * 2
'''

# v1.1.0 moves things around (context drift) but keeps both bugs; scale()
# changes, so a fix of it conflicts there.
MOD_V11 = '"""Module docstring added upstream."""\n\n\n' + MOD_V1.replace(
    "x * 2", "x * 3"
)

FIXTURE_CONFTEST = '''\
import os, sys
tree = os.environ.get("VLLM_TREE")
if tree:
    sys.path.insert(0, tree)
'''

TEST_ADD = '''\
import pytest


@pytest.mark.bug_signature(AssertionError, r"^add is wrong")
def test_add_regression():
    import vllm.mod as m
    assert m.add(2, 3) == 5, "add is wrong"


def test_threshold():
    import vllm.mod as m
    assert m.threshold() in (128, 256)
'''

TEST_SCALE = '''\
import pytest


@pytest.mark.bug_signature(AssertionError, r"^scale is wrong")
def test_scale_regression():
    import vllm.mod as m
    assert m.scale(0) == 0 and m.scale(5) in (5,), "scale is wrong"
'''


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: minutes long; run with VLLM_PATCHES_SLOW=1 or -m slow")


def pytest_collection_modifyitems(config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Slow tests run only when asked for: VLLM_PATCHES_SLOW=1, or a -m
    expression that names them."""
    if os.environ.get("VLLM_PATCHES_SLOW") or "slow" in (
            config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set VLLM_PATCHES_SLOW=1 (or -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def real_cache() -> Path:
    """The tool's default cache, where release wheels are kept."""
    if os.environ.get("VLLM_PATCHES_CACHE"):
        return Path(os.environ["VLLM_PATCHES_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-patches"


def run_offline(*args: str, cwd: Path,
                timeout: int = 1800) -> subprocess.CompletedProcess[str]:
    """apply.py run in `cwd` with the cache `cwd/cache` (isolated_cache),
    offline and without $VLLM_REPO: what the real-base tests run."""
    env = dict(os.environ, VLLM_PATCHES_OFFLINE="1",
               VLLM_PATCHES_CACHE=str(cwd / "cache"))
    env.pop("VLLM_REPO", None)
    return subprocess.run([sys.executable, str(APPLY), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def isolated_cache(tmp: Path) -> Path:
    """A cache of the test's own (repository, worktrees, branches) that
    shares the real cache's downloaded release wheels: the real-release
    tests build their bases from the wheels, offline once they are there,
    and never touch the user's patched/<stack> branches or worktrees."""
    dist = real_cache() / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "dist").symlink_to(dist, target_is_directory=True)
    return cache


def git(*args: str, cwd: Path, check: bool = True, **kw) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="Up Stream",
               GIT_AUTHOR_EMAIL="up@example.com", GIT_COMMITTER_NAME="Up Stream",
               GIT_COMMITTER_EMAIL="up@example.com",
               GIT_AUTHOR_DATE="2026-01-01T00:00:00+00:00",
               GIT_COMMITTER_DATE="2026-01-01T00:00:00+00:00")
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                       env=env, **kw)
    if check and p.returncode:
        raise AssertionError(f"git {args}: {p.stderr}")
    return p.stdout.strip()


def submitter(tmp: Path) -> dict[str, str]:
    """An environment whose git identity is a submitter's (export signs off
    with it), whatever the machine's git configuration."""
    cfg = tmp / "gitconfig-user"
    cfg.write_text("[user]\n\tname = Jane Dev\n\temail = jane@example.com\n")
    return {"GIT_CONFIG_GLOBAL": str(cfg), "GIT_CONFIG_NOSYSTEM": "1"}


def git_on_path(bindir: Path, on_am: str) -> dict[str, str]:
    """A `git` in `bindir` that runs the shell lines `on_am` when called as
    `git am` ($REAL is the real git, $PPID the tool) and is the real git
    otherwise; returns the environment that puts it first on PATH."""
    bindir.mkdir()
    real = shutil.which("git")
    (bindir / "git").write_text(
        f'#!/bin/sh\nREAL="{real}"\n'
        'for a in "$@"; do if [ "$a" = am ]; then\n'
        f"{on_am}fi; done\n"
        'exec "$REAL" "$@"\n'
    )
    (bindir / "git").chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}


@dataclass
class Fixture:
    tmp: Path
    upstream: Path
    project: Path
    cache: Path
    patches: dict[str, Path] = field(default_factory=dict)

    @property
    def series(self) -> Path:
        return self.project / "series"

    def run(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        full_env = dict(os.environ, VLLM_PATCHES_CACHE=str(self.cache),
                        VLLM_PATCHES_OFFLINE="1")
        full_env.pop("VLLM_REPO", None)
        full_env.pop("VLLM_PATCHES_FETCHED", None)
        if args and args[0] == "export":  # it signs off: a submitter's identity
            full_env.update(submitter(self.tmp))
        if env:
            full_env.update(env)
        cmd = [sys.executable, str(APPLY), *args]
        if args and args[0] in ("rebase", "status", "test"):
            cmd += ["--series", str(self.series), "--python", sys.executable]
        elif args and args[0] in ("check", "base", "format-patch", "wheel",
                                  "export"):
            cmd += ["--series", str(self.series)]
        else:
            cmd[2:2] = ["--series", str(self.series), "--python", sys.executable]
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env,
                              cwd=cwd or self.tmp, timeout=timeout)

    def report(self, path: Path) -> dict:
        return json.loads(path.read_text())

    def make_patch(self, name: str, edit: dict[str, str], subject: str,
                   tests: list[str], base: str | None = None,
                   status: str = "Pending") -> Path:
        """Commit `edit` in the scratch clone (on `base`, or on the previous
        patch) and export it to patches/ with apply.py format-patch."""
        work = self.tmp / "work"
        if not work.exists():
            git("clone", "-q", str(self.upstream), str(work), cwd=self.tmp)
        if base:
            git("checkout", "-q", "--detach", base, cwd=work)
        for rel, text in edit.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_text(text)
        git("add", "-A", cwd=work)
        trailers = (
            "Bug: https://github.com/vllm-project/vllm/issues/1\n"
            f"Upstream-Status: {status}\n"
            + "".join(f"Tests: {t}\n" for t in tests)
            + "Signed-off-by: vllm-patch-series "
            "<vllm-patch-series@users.noreply.github.com>\n"
        )
        git("commit", "-q", "-m", f"{subject}\n\nWhy it is needed.\n\n"
            + trailers, cwd=work)
        out = self.project / "patches" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, str(APPLY), "format-patch", "--repo",
                            str(work), "HEAD", "--out", str(out)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        self.patches[name] = out
        return out

    def write_series(self, body: str) -> None:
        self.series.write_text(body)

    def snapshot(self) -> dict[str, str]:
        """Everything of the user's checkout that the tool must not change."""
        refs = git("for-each-ref", "--format=%(refname) %(objectname)",
                   cwd=self.upstream)
        refs = "\n".join(r for r in refs.splitlines()
                         if not r.startswith("refs/heads/patched/"))
        return {
            "HEAD": git("rev-parse", "HEAD", cwd=self.upstream),
            "symbolic": git("symbolic-ref", "-q", "HEAD", cwd=self.upstream,
                            check=False),
            "index": git("ls-files", "-s", cwd=self.upstream),
            "status": git("status", "--porcelain", "--untracked-files=all",
                          cwd=self.upstream),
            "refs": refs,
            "worktree": (self.upstream / "vllm" / "mod.py").read_text(),
            "stash": git("stash", "list", cwd=self.upstream),
        }


def make_upstream(up: Path, files: dict[str, str], mod_v11: str) -> Path:
    """A vLLM-like repository: `files` tagged v1.0.0, vllm/mod.py changed to
    `mod_v11` tagged v1.1.0, and the user's own state the tool must leave
    alone: a branch, a local edit, an untracked file and a staged change."""
    up.mkdir()
    git("init", "-q", "-b", "main", cwd=up)
    for rel, text in files.items():
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_text(text)
    git("add", "-A", cwd=up)
    git("commit", "-q", "-m", "v1.0.0", cwd=up)
    git("tag", "v1.0.0", cwd=up)
    (up / "vllm" / "mod.py").write_text(mod_v11)
    git("commit", "-q", "-am", "v1.1.0", cwd=up)
    git("tag", "v1.1.0", cwd=up)
    git("checkout", "-q", "-b", "mywork", cwd=up)
    (up / "vllm" / "mod.py").write_text(mod_v11 + "# my local edit\n")
    (up / "notes.txt").write_text("untracked\n")
    (up / "vllm" / "__init__.py").write_text("# staged\n")
    git("add", "vllm/__init__.py", cwd=up)
    return up


@pytest.fixture
def fx(tmp_path: Path) -> Fixture:
    up = make_upstream(tmp_path / "upstream",
                       {"vllm/__init__.py": "", "vllm/mod.py": MOD_V1}, MOD_V11)
    proj = tmp_path / "project"
    (proj / "tests" / "patches").mkdir(parents=True)
    (proj / "tests" / "patches" / "conftest.py").write_text(FIXTURE_CONFTEST)
    (proj / "tests" / "patches" / "test_add.py").write_text(TEST_ADD)
    (proj / "tests" / "patches" / "test_scale.py").write_text(TEST_SCALE)
    return Fixture(tmp_path, up, proj, tmp_path / "cache")


FIXED_ADD = MOD_V1.replace("return a - b  # bug: subtraction", "return a + b")
FIXED_BOTH = FIXED_ADD.replace("return x * 2", "return x * 1")
REG_ADD = "tests/patches/test_add.py::test_add_regression"
REG_SCALE = "tests/patches/test_scale.py::test_scale_regression"


def standard_stack(fx: Fixture, tag: str = "v1.0.0") -> None:
    """Two patches pinned to v1.0.0: fix add (0001), then fix scale (0002)."""
    fx.make_patch("fx/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                  "[Core] Fix add", [REG_ADD, "tests/patches/test_add.py"],
                  base="v1.0.0")
    fx.make_patch("fx/0002-fix-scale.patch", {"vllm/mod.py": FIXED_BOTH},
                  "[Core] Fix scale", [REG_SCALE])
    fx.write_series(
        "# fixture series\n"
        f"#@ stack fx repo=https://example.invalid/vllm tag={tag}\n"
        "fx/0001-fix-add.patch\n"
        "fx/0002-fix-scale.patch\n")
