"""Offline bases from pinned files (``assemble=`` + ``--fetched DIR``).

The fixture mirrors the dsv4 stack: a stack pinned to a pull-request commit
that cannot be fetched (``fork`` C2), whose first patch is pinned to another
commit of another repository (``up`` C1, ``#@ pin``). Its base is assembled
from the v1.0.0 release wheel and the two pre-fix files, saved as
``DIR/<owner>-<name>-<commit>/<path>``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURE_CONFTEST, MOD_V1, REG_ADD, Fixture, git

FEATURE_BUGGY = "def double(x):\n    return x + x + 1  # bug\n"
FEATURE_FIXED = "def double(x):\n    return x + x\n"
MOD_PR = MOD_V1 + "\n\nEXTRA = 1\n"  # the PR's version of vllm/mod.py
MOD_PR_FIXED = MOD_PR.replace("return a - b  # bug: subtraction", "return a + b")

TEST_FEATURE = '''\
import pytest


@pytest.mark.bug_signature(AssertionError, r"^double is wrong")
def test_double_regression():
    import vllm.feature as f
    assert f.double(2) == 4, "double is wrong"
'''
REG_DOUBLE = "tests/patches/test_feature.py::test_double_regression"
P1, P2 = "pr/0001-fix-double.patch", "pr/0002-fix-add.patch"


def blob(text: str) -> str:
    return subprocess.run(
        ["git", "hash-object", "--stdin"], input=text, capture_output=True,
        text=True, check=True).stdout.strip()


def release_wheel(dist: Path) -> Path:
    """The v1.0.0 'release wheel' (only its vllm/ files matter here)."""
    dist.mkdir(parents=True, exist_ok=True)
    whl = dist / "vllm-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/mod.py", MOD_V1)
        zf.writestr("vllm-1.0.0.dist-info/METADATA", "Name: vllm\nVersion: 1.0.0\n")
    return whl


@pytest.fixture
def pr(fx: Fixture) -> dict:
    """C1 adds the buggy feature (pinned for 0001); C2, the stack's pin, on
    top of it fixes the feature and changes mod.py (0002 is made on it)."""
    work = fx.tmp / "work"
    git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "vllm" / "feature.py").write_text(FEATURE_BUGGY)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "PR: add feature", cwd=work)
    c1 = git("rev-parse", "HEAD", cwd=work)
    (work / "vllm" / "feature.py").write_text(FEATURE_FIXED)
    (work / "vllm" / "mod.py").write_text(MOD_PR)
    git("commit", "-q", "-am", "PR: more", cwd=work)
    c2 = git("rev-parse", "HEAD", cwd=work)
    tests = fx.project / "tests" / "patches"
    (tests / "test_feature.py").write_text(TEST_FEATURE)
    assert (tests / "conftest.py").read_text() == FIXTURE_CONFTEST
    fx.make_patch(P1, {"vllm/feature.py": FEATURE_FIXED}, "[Core] Fix double",
                  [REG_DOUBLE, "tests/patches/test_feature.py"], base=c1)
    fx.make_patch(P2, {"vllm/mod.py": MOD_PR_FIXED}, "[Core] Fix add",
                  [REG_ADD, "tests/patches/test_add.py"], base=c2)
    fx.write_series(
        "#@ stack pr repo=https://example.invalid/fork/vllm branch=pr "
        f"commit={c2} assemble=v1.0.0\n"
        f"#@ pin {P1} repo=https://example.invalid/up/vllm commit={c1}\n"
        f"{P1}\n{P2}\n")
    release_wheel(fx.cache / "dist")
    fetched = fx.tmp / "fetched"
    files = {fetched / f"up-vllm-{c1}" / "vllm" / "feature.py": FEATURE_BUGGY,
             fetched / f"fork-vllm-{c2}" / "vllm" / "mod.py": MOD_PR}
    for path, text in files.items():
        path.parent.mkdir(parents=True)
        path.write_text(text)
    return {"c1": c1, "c2": c2, "dir": fetched, "files": list(files)}


def one_line_error(p: subprocess.CompletedProcess[str], *words: str) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    # (the release's commit from its wheel, made first, says so)
    lines = [ln for ln in p.stderr.strip().splitlines()
             if not ln.startswith("apply.py: committing ")]
    assert len(lines) == 1 and lines[0].startswith("apply.py: error: "), p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_assembled_base_is_deterministic(fx: Fixture, pr: dict) -> None:
    """A good pair of files: the same commit id from two caches, on the
    release's commit, holding exactly the pinned files; --fetched and
    $VLLM_PATCHES_FETCHED are the same."""
    p = fx.run("base", "--stack", "pr", "--fetched", str(pr["dir"]))
    assert p.returncode == 0, p.stderr
    rev, commit, *rest = p.stdout.split()
    assert rev == "v1.0.0+pins"
    assert "source=fetched" in rest and f"fetched={pr['dir']}" in rest
    other = fx.tmp / "cache2"
    release_wheel(other / "dist")
    p2 = fx.run("base", "--stack", "pr",
                env={"VLLM_PATCHES_CACHE": str(other),
                     "VLLM_PATCHES_FETCHED": str(pr["dir"])})
    assert p2.returncode == 0, p2.stderr
    assert p2.stdout.split()[1] == commit
    repo = fx.cache / "vllm.git"
    assert git("rev-parse", f"{commit}^", cwd=repo) == git(
        "rev-parse", "v1.0.0", cwd=repo)
    changed = git("diff", "--name-only", "v1.0.0", commit, cwd=repo).split()
    assert changed == ["vllm/feature.py", "vllm/mod.py"]
    assert git("show", f"{commit}:vllm/feature.py", cwd=repo) + "\n" == FEATURE_BUGGY
    msg = git("log", "-1", "--format=%an <%ae> %ad%n%B", "--date=raw", commit,
              cwd=repo)
    assert msg.startswith("vllm-patch-series <vllm-patch-series@users.noreply."
                          "github.com> 946684800 +0000")
    assert f"https://example.invalid/up/vllm {pr['c1']}" in msg
    assert f"blob {blob(MOD_PR)}" in msg
    # the patches re-export byte-identically from the assembled base
    p = fx.run("check", "--fetched", str(pr["dir"]))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"stack pr: export round-trip on {commit[:12]}: byte-identical" \
        in p.stdout


def test_missing_pinned_file(fx: Fixture, pr: dict) -> None:
    gone = pr["files"][0]
    gone.unlink()
    line = one_line_error(
        fx.run("--fetched", str(pr["dir"])), str(gone), "is missing",
        blob(FEATURE_BUGGY), f"git show {pr['c1']}:vllm/feature.py")
    assert "Traceback" not in line


def test_pinned_file_with_another_blob(fx: Fixture, pr: dict) -> None:
    bad = pr["files"][1]
    bad.write_text(MOD_PR + "# saved from the wrong commit\n")
    one_line_error(
        fx.run("base", "--stack", "pr", "--fetched", str(pr["dir"])), str(bad),
        f"is blob {blob(bad.read_text())}", f"was made on blob {blob(MOD_PR)}",
        P2)


def test_fetched_dir_that_does_not_exist(fx: Fixture, pr: dict) -> None:
    one_line_error(fx.run("--fetched", str(fx.tmp / "nope")), "--fetched",
                   "no such directory")
    one_line_error(fx.run("--no-tests", env={
        "VLLM_PATCHES_FETCHED": str(fx.tmp / "nope")}),
        "$VLLM_PATCHES_FETCHED", "no such directory")


def test_main_job_verifies_stack_from_fetched_files(fx: Fixture, pr: dict) -> None:
    out = fx.tmp / "r.json"
    p = fx.run("--json", str(out), env={"VLLM_PATCHES_FETCHED": str(pr["dir"])})
    assert p.returncode == 0, p.stdout + p.stderr
    st = fx.report(out)["stacks"][0]
    assert st["status"] == "ran" and st["ok"]
    assert st["source"] == "fetched" and st["fetched"] == str(pr["dir"])
    assert st["base"] == "v1.0.0+pins"
    assert st["assembled"]["release"] == "v1.0.0"
    assert [f["path"] for f in st["assembled"]["files"]] == [
        "vllm/feature.py", "vllm/mod.py"]
    for row in st["patches"]:
        assert row["apply"] == "clean", row
        assert row["regression"] == {"base": "fail", "patched": "pass"}, row
        assert row["tests"] == "pass", row
    header = (f"== stack pr on v1.0.0+pins ({st['base_commit'][:12]}, from "
              f"fetched {pr['dir']}: v1.0.0 + 2 pinned files)")
    assert header in p.stdout.splitlines()
    assert "not verified" not in p.stdout


def test_without_fetched_dir_stack_is_skipped(fx: Fixture, pr: dict) -> None:
    """No pinned files given: skipped, not verified, with the fetch hint."""
    out = fx.tmp / "r.json"
    p = fx.run("--json", str(out), env={"VLLM_PATCHES_FETCHED": ""})
    assert p.returncode == 1
    st = fx.report(out)["stacks"][0]
    assert st["status"] == "skipped"
    repo = fx.cache / "vllm.git"
    assert st["fetch"] == (
        f"git -C {repo} fetch https://example.invalid/fork/vllm {pr['c2']} && "
        f"git -C {repo} fetch https://example.invalid/up/vllm {pr['c1']}")
    assert f"== stack pr: SKIPPED, not verified: base {pr['c2']} unavailable" \
        in p.stdout
    assert f"   to get it: {st['fetch']}" in p.stdout
    assert "WARNING: not verified (base unavailable): pr" in p.stdout


def test_wheel_from_assembled_base(fx: Fixture, pr: dict) -> None:
    """The patched wheel of an assembled base is the release's wheel with
    the pinned files and the patches in it."""
    from test_deliver import make_wheel

    files = {"vllm/__init__.py": b"", "vllm/mod.py": MOD_V1.encode()}
    src = make_wheel(fx.tmp, "1.0.0", files)
    for old in (fx.cache / "dist").iterdir():  # the release is this wheel
        old.unlink()
    shutil.copy(src, fx.cache / "dist")
    p = fx.run("wheel", "--stack", "pr", "--fetched", str(pr["dir"]),
               "--from-wheel", str(src), "--out", str(fx.tmp / "o"),
               "--python", sys.executable)
    assert p.returncode == 0, p.stdout + p.stderr
    whl = Path(p.stdout.splitlines()[0])
    assert re.fullmatch(r"vllm-1\.0\.0\+pr\.[0-9a-f]{8}-.*\.whl", whl.name)
    with zipfile.ZipFile(whl) as zf:
        assert zf.read("vllm/feature.py").decode() == FEATURE_FIXED
        assert zf.read("vllm/mod.py").decode() == MOD_PR_FIXED
        info = next(n for n in zf.namelist() if n.endswith("vllm_patches.json"))
        manifest = json.loads(zf.read(info))
    assert manifest["files"] == {"vllm/feature.py": "A", "vllm/mod.py": "M"}
    assert manifest["assembled"]["release"] == "v1.0.0"


def test_rebase_onto_a_real_base_drops_assemble(fx: Fixture, pr: dict) -> None:
    """Once the stack moves to a base that exists, assemble= (and the old
    pin) leave its line; the assembled old base still gives the old stack."""
    git("push", "-q", str(fx.upstream), f"{pr['c1']}:refs/tags/v1.0.7",
        cwd=fx.tmp / "work")
    p = fx.run("rebase", "--onto", "v1.0.7", "--repo", str(fx.upstream),
               "--fetched", str(pr["dir"]))
    assert p.returncode == 0, p.stdout + p.stderr
    line = fx.series.read_text().splitlines()[0]
    assert line == ("#@ stack pr repo=https://example.invalid/fork/vllm "
                    f"tag=v1.0.7 commit={pr['c1']}")
