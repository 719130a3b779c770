"""Integration on a real vLLM release: the v0.20.2 base built offline from the
release wheel (pip's cache or a download), and a small fixture stack on it."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import git, isolated_cache, real_cache, run_offline

PIN = "bc150f50299199599673614f80d12a196f377655"
TQ = "vllm/v1/attention/backends/turboquant_attn.py"
TEST = '''\
import ast, os
from pathlib import Path

import pytest


def threshold():
    src = Path(os.environ["VLLM_TREE"], "{tq}").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and \\
                node.targets[0].id == "_CONTINUATION_DECODE_THRESHOLD":
            return node.value.value


@pytest.mark.bug_signature(AssertionError, r"^threshold 128, want 64")
def test_threshold_regression():
    assert threshold() == 64, f"threshold {{threshold()}}, want 64"
'''.format(tq=TQ)


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_offline(*args, cwd=cwd, timeout=1800)


def test_real_v0_20_2_base_and_fixture_stack(tmp_path: Path) -> None:
    isolated_cache(tmp_path)  # the base is built here, from the release wheel
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "tests" / "test_threshold.py").write_text(TEST)
    (proj / "series").write_text(
        f"#@ stack tq repo=https://github.com/vllm-project/vllm tag=v0.20.2 "
        f"commit={PIN}\n")
    # the base, from the tool's cache (built from the PyPI wheel if needed)
    p = run("base", "--series", str(proj / "series"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rev, commit, repo = p.stdout.split()[:3]
    repo = repo.split("=", 1)[1]
    assert rev == "v0.20.2" and "upstream=bc150f502" in p.stdout
    assert "source=pypi" in p.stdout
    # the same release gives the same commit as in the shared cache, if any
    shared = real_cache() / "vllm.git"
    if (shared / "HEAD").exists():
        known = git("rev-parse", "--verify", "-q", "v0.20.2^{commit}", cwd=shared,
                    check=False)
        assert known in ("", commit)
    # a patch made on a clone of that base
    work = tmp_path / "work"
    git("clone", "-q", "--no-checkout", repo, str(work), cwd=tmp_path)
    git("checkout", "-q", "--detach", commit, cwd=work)
    f = work / TQ
    f.write_text(f.read_text().replace("_CONTINUATION_DECODE_THRESHOLD = 128",
                                       "_CONTINUATION_DECODE_THRESHOLD = 64"))
    git("commit", "-q", "-am",
        "[Attention][TurboQuant] Lower the threshold\n\nWhy.\n\n"
        "Bug: https://github.com/vllm-project/vllm/issues/1\n"
        "Upstream-Status: Inappropriate [fixture]\n"
        "Tests: tests/test_threshold.py::test_threshold_regression\n"
        "Signed-off-by: vllm-patch-series "
        "<vllm-patch-series@users.noreply.github.com>", cwd=work)
    (proj / "patches" / "tq").mkdir(parents=True)
    p = run("format-patch", "--repo", str(work), "HEAD", "--out",
            str(proj / "patches" / "tq" / "0001-threshold.patch"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    with (proj / "series").open("a") as fh:
        fh.write("tq/0001-threshold.patch\n")
    # lint with the round trip on the real base
    p = run("check", "--series", str(proj / "series"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "byte-identical" in p.stdout
    out = tmp_path / "r.json"
    p = run("--series", str(proj / "series"), "--python", sys.executable,
            "--json", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads(out.read_text())["stacks"][0]
    assert st["base_commit"] == commit
    assert st["upstream_commit"] == "bc150f502"
    row = st["patches"][0]
    assert row["apply"] == "clean"
    assert row["regression"] == {"base": "fail", "patched": "pass"}


def fake_index(path: Path, version: str) -> Path:
    """A find-links folder whose only vllm is a stand-in wheel of `version`."""
    path.mkdir()
    tag = "cp38-abi3-manylinux_2_28_x86_64"
    info = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(path / f"vllm-{version}-{tag}.whl", "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   f"Root-Is-Purelib: false\nTag: {tag}\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_base_that_is_no_release(tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A release the package index does not have is bad input (exit 2, one
    line naming the newest it has); an index that cannot be reached leaves
    the base unverified with the command to fetch it (exit 1), not a bug."""
    isolated_cache(tmp_path)  # the stack's pin, v0.20.2, from the real wheel
    assert run("base", "v0.20.2", cwd=tmp_path).returncode == 0
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake_index(tmp_path / "idx", "0.1.0")))
    p = run("--base", "v9.9.9", "--stack", "tq", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == ("apply.py: error: vllm 9.9.9 is not a release "
                                "with a wheel for Linux x86_64 (the newest is "
                                "0.1.0)"), p.stderr
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    p = run("--base", "v9.9.9", "--stack", "tq", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "not verified (base unavailable): tq" in p.stdout
    assert "pip download --no-deps --only-binary=:all: vllm==9.9.9" in p.stdout
