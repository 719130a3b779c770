"""applylib.warm: pytest runs forked from a warm interpreter answer as
`python -m pytest` in a subprocess would: each run imports vLLM from its
own tree, with its own environment and directory; exit codes, output and
timeouts are the run's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from applylib import warm

TEST = '''\
import os, time
import vllm


def test_tree():
    assert vllm.WHERE == os.environ["WANT"], vllm.WHERE
    print("tree", vllm.WHERE, os.getcwd())


def test_slow():
    time.sleep(float(os.environ.get("SLEEP", "0")))
'''


def project(tmp: Path, name: str) -> tuple[Path, Path]:
    """A project with the test above, and a 'tree' whose vllm says `name`."""
    proj, tree = tmp / f"proj-{name}", tmp / f"tree-{name}"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text(f"WHERE = {name!r}\n")
    proj.mkdir()
    (proj / "test_w.py").write_text(TEST)
    return proj, tree


def run(proj: Path, tree: Path, want: str, *args: str, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(tree), WANT=want, **env)
    argv = ["-q", "-p", "no:cacheprovider", "-s", *args, "test_w.py"]
    return warm.run_pytest(sys.executable, argv, proj, full, timeout)


def test_each_run_imports_vllm_from_its_own_tree(tmp_path: Path) -> None:
    first, second = project(tmp_path, "a"), project(tmp_path, "b")
    p = run(*first, "a", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert f"tree a {first[0]}" in p.stdout
    # the same lane's server: vllm was not kept from the run before
    p = run(*second, "b", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert f"tree b {second[0]}" in p.stdout
    p = run(*second, "a", "-k", "tree")  # its own check fails: exit 1
    assert p.returncode == 1 and "AssertionError: b" in p.stdout, p.stdout


def test_timeout_kills_the_run(tmp_path: Path) -> None:
    proj, tree = project(tmp_path, "t")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run(proj, tree, "t", "-k", "slow", timeout=3, SLEEP="60")
    assert time.monotonic() - t0 < 30
    p = run(proj, tree, "t", "-k", "tree")  # the server still answers
    assert p.returncode == 0, p.stdout


def test_a_server_that_died_is_replaced(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that died between two runs (before the lane noticed) costs
    its warm modules, not the run: the run goes to a new server."""
    proj, tree = project(tmp_path, "d")
    assert run(proj, tree, "d", "-k", "tree").returncode == 0
    server = warm._local.server
    server.proc.kill()
    server.proc.wait()
    monkeypatch.setattr(server.proc, "poll", lambda: None)  # not noticed yet
    p = run(proj, tree, "d", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert warm._local.server is not server
