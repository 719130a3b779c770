"""Tests of `apply.py wheel`, `apply.py export` and the serving-image recipe
(ci/Dockerfile.serving and its .dockerignore; the image is built for real
in test_image.py).

Fixture repositories first (fast): a small vLLM-like upstream, a fixture
wheel made with the `wheel` package, patches exported with apply.py. Then the
real v0.20.2 release: its official wheel (from the tool's cache, or pip) and
its base, with a small fixture stack that changes a TurboQuant module and adds
a file. The patched wheel is built once per session.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import conftest
import pytest
from conftest import APPLY, ROOT, Fixture, git, submitter

PY = sys.executable
SOB = ("Signed-off-by: vllm-patch-series "
       "<vllm-patch-series@users.noreply.github.com>")
TQ = "vllm/v1/attention/backends/turboquant_attn.py"

MOD = '''\
def add(a, b):
    return a - b  # bug: subtraction


def scale(x):
    return x * 2
'''
MOD_V11 = '"""Upstream docstring."""\n\n\n' + MOD.replace("x * 2", "x * 3")
TQ_V1 = "THRESHOLD = 128\n"

# The series' harness (a stand-in for tests/patches/conftest.py, torch-free).
PROJECT_CONFTEST = '''\
import os
import sys
from pathlib import Path

import pytest

TREE = os.environ.get("VLLM_TREE", "")
if TREE:
    sys.path.insert(0, TREE)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def vllm_tree():
    return Path(TREE).resolve()


@pytest.fixture
def special():
    return 1
'''

TEST_TQ = '''\
"""Regression test of the TurboQuant threshold fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_threshold_regression(vllm_tree):
    import vllm.v1.attention.backends.tq as tq

    assert Path(tq.__file__).resolve().parent.is_relative_to(vllm_tree)
    assert tq.THRESHOLD == 64


def test_tree_is_set():
    assert (Path(os.environ["VLLM_TREE"]) / "vllm").is_dir()


@pytest.mark.gpu
def test_gpu_only():
    raise AssertionError("runs on a GPU only")
'''

TEST_ADD = '''\
def test_add_regression():
    import vllm.mod as m

    assert m.add(2, 3) == 5
'''

TEST_SCALE = '''\
def test_scale_regression():
    import vllm.mod as m

    assert m.scale(5) == 5
'''

FIX_ADD = MOD.replace("return a - b  # bug: subtraction", "return a + b")
# 0003's hunk reaches the line 0002 fixes: it applies only on top of 0002
FIX_BOTH = FIX_ADD.replace("def scale(x):\n    return x * 2",
                           "def scale(x: int) -> int:\n    return x * 1")
NEW_PY = ('# SPDX-License-Identifier: Apache-2.0\n'
          '# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n'
          'HELPER = "new"\n')


def run_tool(*args: str, cache: Path, cwd: Path, env: dict | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, VLLM_PATCHES_CACHE=str(cache),
                VLLM_PATCHES_OFFLINE="1")
    full.pop("VLLM_REPO", None)
    full.update(env or {})
    return subprocess.run([PY, str(APPLY), *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=timeout)


def no_identity(tmp: Path) -> dict[str, str]:
    """An environment where git has no user identity configured."""
    cfg = tmp / "gitconfig-empty"
    cfg.write_text("")
    return {"GIT_CONFIG_GLOBAL": str(cfg), "GIT_CONFIG_NOSYSTEM": "1"}


def record_b64(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def verify_record(whl: Path) -> dict[str, str]:
    """Every RECORD entry's hash and size match the archive; {path: hash}."""
    with zipfile.ZipFile(whl) as zf:
        info = next(n.split("/")[0] for n in zf.namelist()
                    if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.TextIOWrapper(zf.open(f"{info}/RECORD"),
                                                encoding="utf-8")))
        names = {n for n in zf.namelist() if not n.endswith("/")}
        listed = {r[0] for r in rows}
        assert listed == names, (names ^ listed)
        hashes = {}
        for path, digest, size in rows:
            if path == f"{info}/RECORD":
                assert digest == size == ""
                continue
            h = hashlib.sha256()
            n = 0
            with zf.open(path) as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
                    n += len(chunk)
            got = "sha256=" + base64.urlsafe_b64encode(
                h.digest()).rstrip(b"=").decode()
            assert got == digest, path
            assert n == int(size), path
            hashes[path] = digest
    return hashes


def make_wheel(tmp: Path, version: str, files: dict[str, bytes],
               commit: str | None = None) -> Path:
    """A vLLM-like release wheel, made with `wheel pack` and then renamed to
    manylinux as vLLM's release wheels are (WHEEL still says linux_x86_64)."""
    root = tmp / f"wheel-src-{version}" / f"vllm-{version}"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "vllm" / "_version.py").write_text(
        "# file generated by vcs-versioning\n"
        f"__version__ = version = '{version}'\n"
        f"__version_tuple__ = version_tuple = "
        f"{tuple(int(x) for x in version.split('.'))}\n\n"
        f"__commit_id__ = commit_id = {('g' + commit) if commit else None!r}\n")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: vllm\n"
                                   f"Version: {version}\nSummary: fixture\n\n"
                                   "A long description.\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: fixture\n"
                                "Root-Is-Purelib: false\n"
                                "Tag: cp38-abi3-linux_x86_64\n")
    out = tmp / f"wheel-out-{version}"
    out.mkdir()
    p = subprocess.run([PY, "-m", "wheel", "pack", "-d", str(out), str(root)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    built = out / f"vllm-{version}-cp38-abi3-linux_x86_64.whl"
    final = out / f"vllm-{version}-cp38-abi3-manylinux_2_35_x86_64.whl"
    built.rename(final)
    return final


def make_upstream(tmp: Path) -> Path:
    files = {"vllm/__init__.py": "", "vllm/mod.py": MOD,
             "vllm/legacy.py": "OLD = 1\n",
             "vllm/v1/__init__.py": "", "vllm/v1/attention/__init__.py": "",
             "vllm/v1/attention/backends/__init__.py": "",
             "vllm/v1/attention/backends/tq.py": TQ_V1,
             "tests/v1/attention/test_existing.py": "def test_x():\n    pass\n",
             "csrc/kernel.cu": "// kernel\n"}
    return conftest.make_upstream(tmp / "upstream", files, MOD_V11)


def wheel_files(up: Path, rev: str) -> dict[str, bytes]:
    names = git("ls-tree", "-r", "--name-only", rev, "vllm", cwd=up).split()
    files = {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=up,
                               capture_output=True).stdout for n in names}
    files["vllm/_C.abi3.so"] = os.urandom(4096)
    return files


def commit_patch(fx: Fixture, name: str, edit: dict[str, str | None],
                 subject: str, tests: list[str], base: str | None = None,
                 bugs: tuple[str, ...] = (
                     "https://github.com/vllm-project/vllm/issues/41726",)
                 ) -> None:
    """Like Fixture.make_patch, with deletions (None) and Bug: trailers."""
    work = fx.tmp / "work"
    if not work.exists():
        git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    if base:
        git("checkout", "-q", "-f", "--detach", base, cwd=work)
    for rel, text in edit.items():
        if text is None:
            (work / rel).unlink()
            continue
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    git("add", "-A", cwd=work)
    trailers = ("".join(f"Bug: {b}\n" for b in bugs)
                + "Upstream-Status: Pending\n"
                + "".join(f"Tests: {t}\n" for t in tests) + SOB + "\n")
    git("commit", "-q", "-m", f"{subject}\n\nThe bug, its symptom and root "
        "cause.\n\nThe fix.\n\n" + trailers, cwd=work)
    out = fx.project / "patches" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([PY, str(APPLY), "format-patch", "--repo", str(work),
                        "HEAD", "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    fx.patches[name] = out


REG_TQ = "tests/patches/test_tq.py::test_threshold_regression"
REG_ADD = "tests/patches/test_add.py::test_add_regression"
REG_SCALE = "tests/patches/test_scale.py::test_scale_regression"


@pytest.fixture
def dx(tmp_path: Path) -> Fixture:
    """Upstream v1.0.0/v1.1.0 and a project with a three-patch stack 'fx':
    0001 fixes the TurboQuant-like threshold, adds a module, deletes
    vllm/legacy.py and adds an upstream test; 0002 fixes add; 0003 fixes
    scale (its context needs 0002)."""
    up = make_upstream(tmp_path)
    proj = tmp_path / "project"
    (proj / "tests" / "patches" / "fake_helper").mkdir(parents=True)
    (proj / "tests" / "patches" / "conftest.py").write_text(PROJECT_CONFTEST)
    (proj / "tests" / "patches" / "test_tq.py").write_text(TEST_TQ)
    (proj / "tests" / "patches" / "test_add.py").write_text(
        TEST_ADD.replace("import vllm.mod as m",
                         "import vllm.mod as m\n    import fake_helper"))
    (proj / "tests" / "patches" / "fake_helper" / "__init__.py").write_text(
        "X = 1\n")
    (proj / "tests" / "patches" / "unrelated.py").write_text("Y = 2\n")
    (proj / "tests" / "patches" / "test_scale.py").write_text(TEST_SCALE)
    fx = Fixture(tmp_path, up, proj, tmp_path / "cache")
    commit_patch(fx, "fx/0001-tq-threshold.patch",
                 {"vllm/v1/attention/backends/tq.py": "THRESHOLD = 64\n",
                  "vllm/v1/attention/backends/tq_helper.py": NEW_PY,
                  "vllm/legacy.py": None,
                  "tests/v1/attention/test_tq_upstream.py": "def test_y():\n"
                  "    pass\n"},
                 "[Attention][TurboQuant] Lower the threshold",
                 [REG_TQ, "tests/patches/test_tq.py"], base="v1.0.0",
                 bugs=("https://github.com/vllm-project/vllm/issues/41726",
                       "https://github.com/vllm-project/vllm/pull/40941"))
    commit_patch(fx, "fx/0002-fix-add.patch", {"vllm/mod.py": FIX_ADD},
                 "[Core] Fix add", [REG_ADD])
    commit_patch(fx, "fx/0003-fix-scale.patch", {"vllm/mod.py": FIX_BOTH},
                 "[Core] Fix scale", [REG_SCALE])
    fx.write_series("#@ stack fx repo=https://example.invalid/vllm tag=v1.0.0\n"
                    "fx/0001-tq-threshold.patch\n"
                    "fx/0002-fix-add.patch\n"
                    "fx/0003-fix-scale.patch\n")
    return fx


def digest(series: Path, stack_patches: list[str]) -> str:
    h = hashlib.sha256()
    for p in stack_patches:
        h.update(p.encode() + b"\0" + (series.parent / "patches" / p).read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------
# wheel, on fixtures


def test_wheel_fixture_round_trip(dx: Fixture) -> None:
    before = dx.snapshot()
    src = make_wheel(dx.tmp, "1.0.0", wheel_files(dx.upstream, "v1.0.0"),
                     commit=git("rev-parse", "v1.0.0", cwd=dx.upstream)[:9])
    out = dx.tmp / "out"
    p = dx.run("wheel", "--repo", str(dx.upstream), "--from-wheel", str(src),
               "--out", str(out), "--json", str(dx.tmp / "w.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert dx.snapshot() == before
    patches = ["fx/0001-tq-threshold.patch", "fx/0002-fix-add.patch",
               "fx/0003-fix-scale.patch"]
    local = "fx." + digest(dx.series, patches)[:8]
    version = f"1.0.0+{local}"
    whl = out / f"vllm-{version}-cp38-abi3-manylinux_2_35_x86_64.whl"
    assert p.stdout.splitlines()[0] == str(whl)
    assert re.search(r"built in [\d.]+ s \(wheel unpack [\d.]+ s, wheel pack "
                     r"[\d.]+ s\); size \d+ -> \d+ bytes \([+-]\d+ B", p.stdout)
    assert "not in the wheel (not shipped): tests/v1/attention/" \
        "test_tq_upstream.py" in p.stdout
    rep = json.loads((dx.tmp / "w.json").read_text())
    assert rep["wheel"] == str(whl) and rep["version"] == version
    assert rep["size_delta"] == whl.stat().st_size - src.stat().st_size
    assert rep["files"] == {"vllm/legacy.py": "D", "vllm/mod.py": "M",
                            "vllm/v1/attention/backends/tq.py": "M",
                            "vllm/v1/attention/backends/tq_helper.py": "A"}
    hashes = verify_record(whl)
    info = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(whl) as b:
        names_a = {n for n in a.namelist()}
        names_b = {n for n in b.namelist()}
        assert names_b - names_a == {
            "vllm/v1/attention/backends/tq_helper.py", f"{info}/METADATA",
            f"{info}/WHEEL", f"{info}/RECORD", f"{info}/vllm_patches.json"}
        assert {n for n in names_a - names_b if "dist-info" not in n} == {
            "vllm/legacy.py"}
        # changed files are the patched tree's, every other file the wheel's
        assert b.read("vllm/mod.py").decode() == FIX_BOTH
        assert b.read("vllm/v1/attention/backends/tq.py") == b"THRESHOLD = 64\n"
        assert b.read("vllm/v1/attention/backends/tq_helper.py").decode() == NEW_PY
        for n in names_a & names_b:
            if n not in ("vllm/mod.py", "vllm/v1/attention/backends/tq.py",
                         "vllm/_version.py") and "dist-info" not in n:
                assert a.read(n) == b.read(n), n
                assert hashes[n] == record_b64(a.read(n))
        ver = b.read("vllm/_version.py").decode()
        assert f"__version__ = version = '{version}'" in ver
        assert f"__version_tuple__ = version_tuple = (1, 0, 0, '{local}')" in ver
        meta = b.read(f"{info}/METADATA").decode()
        assert f"\nVersion: {version}\n" in meta and "A long description." in meta
        assert "Tag: cp38-abi3-manylinux_2_35_x86_64" in b.read(
            f"{info}/WHEEL").decode()
        man = json.loads(b.read(f"{info}/vllm_patches.json"))
        assert man["files"] == rep["files"] and man["stack"] == "fx"
        assert [x["file"] for x in man["patches"]] == patches
        # what status --installed compares installed files with
        assert man["patches"][2]["files"] == ["vllm/mod.py"]
        assert man["file_hashes"] == {
            "vllm/legacy.py": {"release": record_b64(b"OLD = 1\n"),
                               "patched": None},
            "vllm/mod.py": {"release": record_b64(MOD.encode()),
                            "patched": record_b64(FIX_BOTH.encode())},
            "vllm/v1/attention/backends/tq.py": {
                "release": record_b64(TQ_V1.encode()),
                "patched": record_b64(b"THRESHOLD = 64\n")},
            "vllm/v1/attention/backends/tq_helper.py": {
                "release": None, "patched": record_b64(NEW_PY.encode())}}
    # deterministic: the same series on the same wheel gives the same bytes
    data = whl.read_bytes()
    p = dx.run("wheel", "--repo", str(dx.upstream), "--from-wheel", str(src),
               "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert whl.read_bytes() == data


def test_wheel_refusals(dx: Fixture) -> None:
    src = make_wheel(dx.tmp, "1.0.0", wheel_files(dx.upstream, "v1.0.0"))
    other = make_wheel(dx.tmp, "1.1.0", wheel_files(dx.upstream, "v1.1.0"))
    base = ("wheel", "--repo", str(dx.upstream), "--out", str(dx.tmp / "o"))
    # a wheel of another release
    p = dx.run(*base, "--from-wheel", str(other))
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1
    assert "is vLLM 1.1.0, but the base v1.0.0 is release 1.0.0" in p.stderr
    # a wheel that is not the official one (already patched)
    patched = src.with_name(src.name.replace("1.0.0", "1.0.0+x.1"))
    patched.write_bytes(src.read_bytes())
    p = dx.run(*base, "--from-wheel", str(patched))
    assert p.returncode == 2 and "is vLLM 1.0.0+x.1" in p.stderr
    # a base that is not a release
    p = dx.run(*base, "--from-wheel", str(src), "--base", "mywork")
    assert p.returncode == 2 and "not a vLLM release" in p.stderr
    # the 'wheel' package missing from the Python that runs it
    venv = dx.tmp / "bare"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True)
    p = dx.run(*base, "--from-wheel", str(src), "--python",
               str(venv / "bin" / "python"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "the 'wheel' package is missing" in p.stderr
    assert "pip install -U 'wheel>=0.48'" in p.stderr
    # a series that changes compiled sources
    commit_patch(dx, "fx/0004-kernel.patch", {"csrc/kernel.cu": "// fixed\n"},
                 "[Kernel] Fix", [REG_ADD])
    with dx.series.open("a") as fh:
        fh.write("fx/0004-kernel.patch\n")
    p = dx.run(*base, "--from-wheel", str(src))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "patches/fx/0004-kernel.patch changes csrc/kernel.cu" in p.stderr
    assert not (dx.tmp / "o").exists() or not list((dx.tmp / "o").iterdir())


def test_wheel_refuses_a_wheel_whose_file_differs_from_the_base(dx: Fixture) -> None:
    """The wheel's copy of a file the series changes is not the base's: the
    patch was checked against another file. Refused (exit 2, one line,
    nothing written) unless --force, which ships base + patch and warns."""
    files = wheel_files(dx.upstream, "v1.0.0")
    files["vllm/mod.py"] += b"# a hotfix in the wheel only\n"
    src = make_wheel(dx.tmp, "1.0.0", files)
    out = dx.tmp / "o"
    base = ("wheel", "--repo", str(dx.upstream), "--from-wheel", str(src))
    p = dx.run(*base, "--out", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "vllm/mod.py differs from base v1.0.0's" in p.stderr
    assert "--force" in p.stderr
    assert not out.exists() or not list(out.glob("*.whl"))
    p = dx.run(*base, "--out", str(out), "--force")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "vllm/mod.py in the official wheel differs from base v1.0.0's" in (
        p.stdout + p.stderr)


def test_wheel_conflict_writes_nothing(dx: Fixture) -> None:
    # 0003 (x * 2 -> x * 1) cannot apply on v1.1.0 (x * 3)
    src = make_wheel(dx.tmp, "1.1.0", wheel_files(dx.upstream, "v1.1.0"))
    p = dx.run("wheel", "--repo", str(dx.upstream), "--base", "v1.1.0",
               "--from-wheel", str(src), "--out", str(dx.tmp / "o"))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "fx/0003-fix-scale.patch: does not apply on v1.1.0" in p.stdout
    assert "no wheel written" in p.stderr
    assert not list((dx.tmp / "o").glob("*.whl")) if (dx.tmp / "o").exists() \
        else True


# --------------------------------------------------------------------------
# export, on fixtures


def am_round_trip(repo: Path, ref: str, parent: str, tmp: Path,
                  patch_file: Path | None = None) -> None:
    """git am of git format-patch -1 of the branch (or of the patch file the
    export wrote, with am -k) gives the same commit."""
    if patch_file is None:
        mbox = subprocess.run(["git", "format-patch", "-1", "--stdout", ref],
                              cwd=repo, capture_output=True, check=True).stdout
        keep = "--keep-non-patch"  # drop only [PATCH], keep [Component]
    else:
        mbox, keep = patch_file.read_bytes(), "--keep"
    clone = tmp / f"am-{ref.rsplit('/', 1)[-1]}-{keep}"
    git("clone", "-q", "--no-checkout", str(repo), str(clone), cwd=tmp)
    git("checkout", "-q", "--detach", parent, cwd=clone)
    p = subprocess.run(["git", "-c", "user.name=T", "-c", "user.email=t@x",
                        "am", "-q", keep], cwd=clone, input=mbox,
                       capture_output=True)
    assert p.returncode == 0, p.stderr
    fmt = "%T%n%an <%ae> %ad%n%B"
    assert git("log", "-1", f"--format={fmt}", "HEAD", cwd=clone) == \
        git("log", "-1", f"--format={fmt}", ref, cwd=repo)


def test_export_pr_branch(dx: Fixture) -> None:
    before = dx.snapshot()
    # no identity to sign off with: refused before any work (no placeholder)
    p = dx.run("export", "0001", "--repo", str(dx.upstream),
               env=no_identity(dx.tmp))
    assert p.returncode == 2 and p.stderr.startswith(
        "apply.py: error: no git identity to sign off with"), p.stderr
    assert dx.snapshot() == before
    env = submitter(dx.tmp)
    p = dx.run("export", "0001", "--repo", str(dx.upstream), "--json",
               str(dx.tmp / "e.json"), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert dx.snapshot() == before
    ref = "refs/heads/patched/pr/fx-0001-tq-threshold"
    up = dx.upstream
    base = git("rev-parse", "v1.0.0", cwd=up)
    # exactly one commit, on the stack's base
    assert git("rev-list", "--count", f"{base}..{ref}", cwd=up) == "1"
    assert git("rev-parse", f"{ref}^", cwd=up) == base
    files = git("diff", "--name-status", base, ref, cwd=up).splitlines()
    assert sorted(files) == sorted([
        "D\tvllm/legacy.py", "M\tvllm/v1/attention/backends/tq.py",
        "A\tvllm/v1/attention/backends/tq_helper.py",
        "A\ttests/v1/attention/test_tq_upstream.py",
        "A\ttests/v1/attention/test_tq.py"])
    msg = git("log", "-1", "--format=%B", ref, cwd=up)
    assert msg.startswith("[Attention][TurboQuant] Lower the threshold\n\n"
                          "## Purpose\n\nThe bug, its symptom and root cause."
                          "\n\nThe fix.\n\nFIX #41726\nRelated: "
                          "https://github.com/vllm-project/vllm/pull/40941\n\n"
                          "## Test Plan\n")
    assert "pytest -v tests/v1/attention/test_tq.py::test_threshold_regression" \
        in msg
    assert "## Test Result\n\nNot run yet: paste the Test Plan's output" in msg
    assert "Upstream-Status" not in msg and "Tests:" not in msg
    assert "Bug:" not in msg
    assert msg.rstrip().endswith("\nSigned-off-by: Jane Dev <jane@example.com>")
    assert msg.count("Signed-off-by:") == 1  # the series' own is left out
    assert git("log", "-1", "--format=%an <%ae>|%cn", ref, cwd=up) == \
        "Up Stream <up@example.com>|Jane Dev"
    # the adapted test: harness fixtures defined in the module, gpu mark kept
    test = git("show", f"{ref}:tests/v1/attention/test_tq.py", cwd=up)
    assert test.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert "def vllm_tree() -> Path:" in test and "_needs_gpu" in test
    assert "pytest.mark.gpu" not in test
    assert 'os.environ.setdefault(\n    "VLLM_TREE"' in test
    compile(test, "test_tq.py", "exec")
    # printed: where things are and the commands to run
    assert p.stdout.startswith(f"{ref} in {up}\n")
    assert f"git -C {up} push YOUR_FORK_REMOTE {ref}:refs/heads/pr/" \
           "fx-0001-tq-threshold" in p.stdout
    assert "gh pr create --repo vllm-project/vllm --base main --head " \
           "YOUR_GITHUB_USER:pr/fx-0001-tq-threshold --title '[Attention]" \
           "[TurboQuant] Lower the threshold' --body-file " in p.stdout
    assert "signed off by: Jane Dev <jane@example.com>" in p.stdout
    rep = json.loads((dx.tmp / "e.json").read_text())
    body = Path(rep["body_file"]).read_text()
    assert body.startswith("## Purpose\n") and "Signed-off-by" not in body
    am_round_trip(up, ref, base, dx.tmp)
    am_round_trip(up, ref, base, dx.tmp, Path(rep["patch_file"]))
    # the adapted test runs in vLLM's tree layout: fails before the change,
    # passes with it (the GPU-only test skips). A stub stands in for torch
    # (importing the real one twice costs more than the rest of this test).
    stub = dx.tmp / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "from types import SimpleNamespace\n"
        "cuda = SimpleNamespace(is_available=lambda: False)\n"
        "accelerator = SimpleNamespace(current_accelerator=lambda: None,\n"
        "                              empty_cache=lambda: None)\n")
    for rev, want in ((ref, "2 passed, 1 skipped"),
                      (base, "1 failed, 1 passed, 1 skipped")):
        tree = dx.tmp / f"tree-{rev[:6].replace('/', '-')}"
        git("worktree", "add", "-q", "--detach", str(tree), rev, cwd=up)
        tf = tree / "tests" / "v1" / "attention" / "test_tq.py"
        tf.write_text(test)
        r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(tf)], cwd=tree, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=f"{tree}:"
                                    f"{stub.parent}"))
        assert want in r.stdout, r.stdout + r.stderr
        git("worktree", "remove", "--force", str(tree), cwd=up)


def test_export_author_is_the_submitter(dx: Fixture) -> None:
    """A patch the series wrote (its author the series' placeholder) is
    exported as the submitter's: author, committer and the one sign-off
    alike, so vLLM's DCO check passes; GIT_AUTHOR_* is honoured over the
    git configuration; the placeholder is nowhere in the commit or the
    .patch file. (Before, the author stayed the placeholder.)"""
    f = dx.project / "patches" / "fx" / "0002-fix-add.patch"
    f.write_text(f.read_text().replace(
        "From: Up Stream <up@example.com>",
        "From: vllm-patch-series <vllm-patch-series@users.noreply.github.com>"))
    env = submitter(dx.tmp)
    out = dx.tmp / "e.json"
    p = dx.run("export", "0002", "--repo", str(dx.upstream), "--json", str(out),
               env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    ref = "refs/heads/patched/pr/fx-0002-fix-add"
    who = git("log", "-1", "--format=%an <%ae>|%cn <%ce>", ref, cwd=dx.upstream)
    assert who == "Jane Dev <jane@example.com>|Jane Dev <jane@example.com>", who
    raw = git("cat-file", "commit", ref, cwd=dx.upstream)
    patch = Path(json.loads(out.read_text())["patch_file"]).read_text()
    for text in (raw, patch):
        assert "vllm-patch-series" not in text, text
    assert "\nFrom: Jane Dev <jane@example.com>\n" in patch
    assert raw.rstrip().endswith("Signed-off-by: Jane Dev <jane@example.com>")
    env.update(GIT_AUTHOR_NAME="Ann Other", GIT_AUTHOR_EMAIL="ann@example.com")
    p = dx.run("export", "0002", "--repo", str(dx.upstream), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    msg = git("log", "-1", "--format=%an <%ae>%n%B", ref, cwd=dx.upstream)
    assert msg.startswith("Ann Other <ann@example.com>\n"), msg
    assert msg.rstrip().endswith("Signed-off-by: Ann Other <ann@example.com>")


def test_export_to_a_target_off_main(dx: Fixture) -> None:
    """A patch whose code is not on vLLM's main names where it goes
    (Upstream-Target:): export says so instead of a PR against main, and the
    series-only trailers stay out of the PR commit (Related: as a link)."""
    f = dx.project / "patches" / "fx" / "0002-fix-add.patch"
    f.write_text(f.read_text().replace(
        "Upstream-Status: Pending\n",
        "Related: https://example.invalid/pull/7\n"
        "Upstream-Status: Backport [https://example.invalid/commit/1]\n"
        "Upstream-Target: https://example.invalid/pull/8 (review comment): "
        "main has no mod.py\n"))
    c = dx.run("check", "--repo", str(dx.upstream))  # (its other problems:
    assert "Related" not in c.stdout and "Upstream" not in c.stdout  # not ours)
    p = dx.run("export", "0002", "--repo", str(dx.upstream), "--json",
               str(dx.tmp / "e.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("target: https://example.invalid/pull/8 (review comment): main has "
            "no mod.py\n  not a PR against vllm-project/vllm main") in p.stdout
    assert "gh pr create" not in p.stdout
    rep = json.loads((dx.tmp / "e.json").read_text())
    assert rep["target"].startswith("https://example.invalid/pull/8 ")
    msg = git("log", "-1", "--format=%B", rep["ref"], cwd=dx.upstream)
    assert "Related: https://example.invalid/pull/7\n" in msg  # a body link
    assert "Upstream-Target" not in msg and "Upstream-Status" not in msg
    # a Related: that is not a URL is a lint problem
    f.write_text(f.read_text().replace(
        "Related: https://example.invalid/pull/7", "Related: PR 7"))
    c = dx.run("check", "--repo", str(dx.upstream))
    assert "'Related: PR 7' does not start with a URL" in c.stdout, c.stdout


def test_export_dependent_patch_and_identity(dx: Fixture) -> None:
    env = submitter(dx.tmp)
    p = dx.run("export", "fx/0003-fix-scale.patch", "--repo", str(dx.upstream),
               env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    up = dx.upstream
    ref = "refs/heads/patched/pr/fx-0003-fix-scale"
    assert "does not apply on v1.0.0 alone; the branch is based on the " \
           "patches before it: fx/0001-tq-threshold.patch, " \
           "fx/0002-fix-add.patch" in p.stdout
    parent = git("rev-parse", f"{ref}^", cwd=up)
    assert git("log", "--format=%s", f"v1.0.0..{parent}", cwd=up).splitlines() \
        == ["[Core] Fix add", "[Attention][TurboQuant] Lower the threshold"]
    # vllm/mod.py is tested in tests/ (vLLM mirrors its package there)
    assert git("diff", "--name-only", parent, ref, cwd=up).split() == [
        "tests/test_scale.py", "vllm/mod.py"]
    msg = git("log", "-1", "--format=%B", ref, cwd=up)
    assert "FIX #41726\n\nThis change applies on top of (to be merged first):\n" \
           "- [Attention][TurboQuant] Lower the threshold\n- [Core] Fix add\n" \
           in msg
    assert msg.rstrip().endswith("\n\nSigned-off-by: Jane Dev <jane@example.com>")
    assert git("log", "-1", "--format=%cn <%ce>", ref, cwd=up) == \
        "Jane Dev <jane@example.com>"
    am_round_trip(up, ref, parent, dx.tmp)
    # a helper module the test imports travels with it
    p = dx.run("export", "0002", "--repo", str(up), env=env)
    assert p.returncode == 0, p.stderr
    tree = git("ls-tree", "-r", "--name-only", "refs/heads/patched/pr/"
               "fx-0002-fix-add", "tests", cwd=up).split()
    assert "tests/fake_helper/__init__.py" in tree
    assert not any("unrelated" in t for t in tree)
    assert "helper fake_helper copied alongside" in p.stdout


def test_export_pr_text_names_no_project_path(dx: Fixture) -> None:
    """A PR is read alone: a patch message that names this project's paths
    or its series is exported, and export exits 1 naming the lines."""
    f = next((dx.project / "patches" / "fx").glob("0001-*.patch"))
    f.write_text(f.read_text().replace(
        "The fix.\n", "The fix, as the previous patch did (ci/gpu/bench.py).\n"))
    p = dx.run("export", "0001", "--repo", str(dx.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the PR names this project or leaks environment variables (not " \
        "ready):\n  the PR text: The fix, as the previous patch did " \
        "(ci/gpu/bench.py).\n" in p.stdout


def test_export_onto_another_commit(dx: Fixture) -> None:
    """--onto REV: the PR commit carried onto REV of the repository (vLLM's
    main in real use), with the regression tests run there; where it does
    not apply, exit 1 naming the conflict, and no branch."""
    up = dx.upstream
    v11 = git("rev-parse", "v1.1.0", cwd=up)
    p = dx.run("export", "0002", "--repo", str(up), "--onto", "v1.1.0",
               "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    ref = "refs/heads/patched/pr/fx-0002-fix-add"
    assert git("rev-parse", f"{ref}^", cwd=up) == v11
    assert f"  parent: v1.1.0 ({v11[:12]})\n" in p.stdout, p.stdout
    assert "vllm/mod.py" in git("diff", "--name-only", v11, ref, cwd=up)
    assert "on v1.1.0: The regression tests under plain pytest in vLLM's " \
        "tree, before and with this change:" in p.stdout
    assert "| `tests/test_add.py::test_add_regression` | failed | passed |" \
        in p.stdout
    p = dx.run("export", "0003", "--repo", str(up), "--onto", "v1.1.0")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"fx/0003-fix-scale.patch does not apply on v1.1.0 ({v11[:12]}): " \
        "conflicts at vllm/mod.py:" in p.stdout
    assert not git("for-each-ref", "refs/heads/patched/pr/fx-0003-fix-scale",
                   cwd=up)
    p = dx.run("export", "0002", "--repo", str(up), "--onto", "nope")
    assert p.returncode == 2 and "--onto nope: unknown revision" in p.stderr


def test_export_tests_only_for_a_fix_submitted_elsewhere(dx: Fixture) -> None:
    """A patch whose fix another upstream PR carries already
    ('Upstream-Status: Submitted [URL]') is exported as its regression tests
    alone, offered to that PR: the branch holds no fix, the PR text says
    whose fix it tests and closes no issue, --run-tests shows the tests
    failing without the fix and passing with it, and on --onto failing
    there."""
    f = dx.project / "patches" / "fx" / "0002-fix-add.patch"
    f.write_text(f.read_text().replace(
        "Upstream-Status: Pending\n",
        "Upstream-Status: Submitted [https://github.com/vllm-project/vllm/pull/"
        "46461]\n"))
    up = dx.upstream
    p = dx.run("export", "0002", "--repo", str(up), "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    ref = "refs/heads/patched/pr/fx-0002-fix-add"
    tests = ["tests/fake_helper/__init__.py", "tests/test_add.py"]  # no vllm/
    assert git("diff", "--name-only", f"{ref}^", ref, cwd=up).split() == tests
    msg = git("log", "-1", "--format=%B", ref, cwd=up)
    assert msg.startswith("[Core] Regression tests for #46461: fix add\n"), msg
    assert "Regression tests for the fix of #46461, without the fix: they " \
        "fail without #46461's change and pass with it." in msg
    assert "Tests the fix of: https://github.com/vllm-project/vllm/pull/46461" \
        in msg and "FIX #" not in msg
    assert "| test | before | with the fix |" in msg
    assert "tests only: the fix is https://github.com/vllm-project/vllm/pull/" \
        "46461 (Upstream-Status)" in p.stdout
    assert "--title '[Core] Regression tests for #46461: fix add'" in p.stdout
    # offered to that PR; a PR of their own only once it is merged
    assert "to add the tests to https://github.com/vllm-project/vllm/pull/" \
        "46461 (they fail on main without its fix)" in p.stdout
    assert "  gh pr checkout 46461 --repo vllm-project/vllm\n  git am -k " \
        in p.stdout
    assert "to open the PR once https://github.com/vllm-project/vllm/pull/" \
        "46461 is merged, and not before" in p.stdout, p.stdout
    assert "| `tests/test_add.py::test_add_regression` | failed | passed |" in msg
    p = dx.run("export", "0002", "--repo", str(up), "--onto", "v1.1.0",
               "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| `tests/test_add.py::test_add_regression` | failed |\n" in p.stdout
    assert git("diff", "--name-only", "v1.1.0", ref, cwd=up).split() == tests


def test_export_bases_a_patch_on_those_its_test_needs(dx: Fixture) -> None:
    """A patch that applies on the base alone but whose regression test
    needs an earlier patch (here 0001's tq_helper): --run-tests finds the
    test failing with the change too, and export bases the PR on the
    patches before it, where it fails before and passes with it."""
    test = (
        "def test_extra_regression(vllm_tree):\n"
        "    from vllm.v1.attention.backends import tq_helper\n"
        "    from vllm import extra\n\n"
        "    assert extra.VALUE == tq_helper.HELPER\n")
    (dx.project / "tests" / "patches" / "test_extra.py").write_text(test)
    commit_patch(dx, "fx/0004-extra.patch",
                 {"vllm/extra.py": NEW_PY.replace("HELPER", "VALUE")},
                 "[Core] Extra", ["tests/patches/test_extra.py::"
                                  "test_extra_regression"])
    dx.write_series(dx.series.read_text() + "fx/0004-extra.patch\n")
    up = dx.upstream
    p = dx.run("export", "0004", "--repo", str(up), "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fx/0004-extra.patch: its regression tests do not fail before and " \
        "pass with it on the base alone: basing it on the patches before it" \
        in p.stdout
    assert "| `tests/test_extra.py::test_extra_regression` | failed | passed |" \
        in p.stdout, p.stdout
    ref = "refs/heads/patched/pr/fx-0004-extra"
    assert git("log", "--format=%s", f"v1.0.0..{ref}^", cwd=up).splitlines()[-1] \
        == "[Attention][TurboQuant] Lower the threshold"


def test_export_branch_safety_and_errors(dx: Fixture) -> None:
    up = dx.upstream
    before = dx.snapshot()
    p = dx.run("export", "0001", "--repo", str(up), "--branch", "mywork")
    assert p.returncode == 2 and "checked out" in p.stderr
    git("branch", "other", "v1.0.0", cwd=up)
    p = dx.run("export", "0001", "--repo", str(up), "--branch", "other")
    assert p.returncode == 2 and "--force" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert git("rev-parse", "other", cwd=up) == git("rev-parse", "v1.0.0", cwd=up)
    p = dx.run("export", "fx/0001", "--repo", str(up), "--branch", "pr/tq")
    assert p.returncode == 0, p.stderr
    assert "push YOUR_FORK_REMOTE refs/heads/pr/tq:refs/heads/pr/tq" in p.stdout
    p = dx.run("export", "0001", "--repo", str(up), "--branch", "bad..name")
    assert p.returncode == 2 and "not a valid branch name" in p.stderr
    p = dx.run("export", "0009", "--repo", str(up))
    assert p.returncode == 2 and "'0009': no patch of the series" in p.stderr
    p = dx.run("export", "0001", "--repo", str(up), "--base", "nope")
    assert p.returncode == 2 and "unknown revision 'nope'" in p.stderr
    # re-exporting replaces the tool's own branch, nothing else moves
    p = dx.run("export", "0001", "--repo", str(up))
    assert p.returncode == 0
    p = dx.run("export", "0001", "--repo", str(up))
    assert p.returncode == 0
    after = dx.snapshot()
    after["refs"] = "\n".join(r for r in after["refs"].splitlines()
                              if not r.startswith(("refs/heads/pr/tq ",
                                                   "refs/heads/other ")))
    assert after == before


def test_export_on_the_patch_pin(dx: Fixture) -> None:
    """A patch pinned to a base of its own ('#@ pin') is exported on it."""
    up = dx.upstream
    v11 = git("rev-parse", "v1.1.0", cwd=up)
    text = dx.series.read_text().splitlines(keepends=True)
    text.insert(1, f"#@ pin fx/0002-fix-add.patch repo=https://example.invalid/"
                f"vllm commit={v11}\n")
    dx.series.write_text("".join(text))
    p = dx.run("export", "0002", "--repo", str(up))
    assert p.returncode == 0, p.stdout + p.stderr
    assert git("rev-parse", "refs/heads/patched/pr/fx-0002-fix-add^", cwd=up) == v11
    # not at hand: the stack's base, and a note
    text[1] = "#@ pin fx/0002-fix-add.patch repo=https://example.invalid/vllm " \
              f"commit={'1' * 40}\n"
    dx.series.write_text("".join(text))
    p = dx.run("export", "0002", "--repo", str(up))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "own pin 111111111111 is not at hand" in p.stderr
    assert git("rev-parse", "refs/heads/patched/pr/fx-0002-fix-add^", cwd=up) == \
        git("rev-parse", "v1.0.0", cwd=up)


def test_export_run_tests(dx: Fixture) -> None:
    p = dx.run("export", "0001", "--repo", str(dx.upstream), "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    msg = git("log", "-1", "--format=%B", "refs/heads/patched/pr/fx-0001-"
              "tq-threshold", cwd=dx.upstream)
    assert "The regression tests under plain pytest in vLLM's tree, before " \
           "and with this change:\n\n" in msg
    assert "| `tests/v1/attention/test_tq.py::test_threshold_regression` | " \
           "failed | passed |" in msg  # by its id in the PR, no harness
    # a regression test that passes before the change proves nothing there
    test = dx.project / "tests" / "patches" / "test_tq.py"
    test.write_text(test.read_text().replace("tq.THRESHOLD == 64",
                                             "tq.THRESHOLD in (64, 128)"))
    p = dx.run("export", "0001", "--repo", str(dx.upstream), "--run-tests")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "| `tests/v1/attention/test_tq.py::test_threshold_regression` | " \
           "passed | passed |" in p.stdout
    assert "not ready: a regression test did not fail before and pass with " \
           "the change under plain pytest" in p.stdout


KEPT_TEST = """\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
\"\"\"add() of two integers.\"\"\"

from vllm.mod import add


def test_add_small_integers():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, 3) == 1
"""


def test_export_ships_the_test_kept_for_vllm(dx: Fixture) -> None:
    """A patch with its own test written for vLLM (tests/upstream/<stack>/
    <patch>/, files at their paths in vLLM's tree): export ships that file
    as it is and nothing of the series' test or its helper; --run-tests
    runs all of it before and with the change. A kept test that sets an
    environment variable at import, or names this project: not ready."""
    kept = dx.project / "tests/upstream/fx/0002-fix-add/tests/test_mod_add.py"
    kept.parent.mkdir(parents=True)
    kept.write_text(KEPT_TEST)
    p = dx.run("export", "0002", "--repo", str(dx.upstream), "--run-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    ref = "refs/heads/patched/pr/fx-0002-fix-add"
    assert git("diff", "--name-only", f"{ref}~1", ref,
               cwd=dx.upstream).split() == ["tests/test_mod_add.py", "vllm/mod.py"]
    assert git("show", f"{ref}:tests/test_mod_add.py", cwd=dx.upstream) + "\n" \
        == KEPT_TEST
    assert "  test: tests/test_mod_add.py (from tests/upstream/fx/0002-fix-add/" \
        "tests/test_mod_add.py; written for vLLM, copied as it is)" in p.stdout
    msg = git("log", "-1", "--format=%B", ref, cwd=dx.upstream)
    assert "pytest -v tests/test_mod_add.py\n" in msg
    assert "| `tests/test_mod_add.py` | failed | passed |" in msg
    kept.write_text(KEPT_TEST.replace(
        "from vllm.mod import add\n",
        "import os\n\nfrom vllm.mod import add\n\n"
        "os.environ.setdefault(\"TRITON_INTERPRET\", \"1\")  # see ci/gpu/a.py\n"))
    p = dx.run("export", "0002", "--repo", str(dx.upstream), "--force")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the PR names this project or leaks environment variables (not " \
        "ready):\n" \
        "  tests/test_mod_add.py: os.environ.setdefault(\"TRITON_INTERPRET\", " \
        "\"1\")  # see ci/gpu/a.py\n" \
        "  tests/test_mod_add.py: line 9: sets os.environ at import\n" in p.stdout
    # one that skips on this host: the table says why, and nothing is proven
    kept.write_text(KEPT_TEST.replace(
        "from vllm.mod import add\n",
        "import pytest\n\nfrom vllm.mod import add\n\n"
        "pytestmark = pytest.mark.skip(reason=\"needs a GPU\")\n"))
    p = dx.run("export", "0002", "--repo", str(dx.upstream), "--force",
               "--run-tests")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "| `tests/test_mod_add.py` | skipped (needs a GPU) | skipped (needs " \
        "a GPU) |\nnot proven here: a regression test skips on this host (the " \
        "table says why); run export --run-tests where it runs\n" in p.stdout
    msg = git("log", "-1", "--format=%B", ref, cwd=dx.upstream)
    assert "pytest -v tests/test_mod_add.py\n" in msg  # the plan, no result
    assert "skipped (needs a GPU)" not in msg and "| before |" not in msg, msg


# --------------------------------------------------------------------------
# the real v0.20.2 release

PIN = "bc150f50299199599673614f80d12a196f377655"
TQ_MARK = "_VLLM_PATCHES_FIXTURE = 'h8'\n"
REAL_TEST = '''\
"""Fixture regression test: the TurboQuant module carries the marker."""

import importlib


def test_marker_regression(vllm_tree):
    mod = importlib.import_module("vllm.v1.attention.backends.turboquant_attn")
    assert mod._VLLM_PATCHES_FIXTURE == "h8"
'''
REAL_NEW = "vllm/v1/attention/backends/turboquant_h8_helper.py"


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The real v0.20.2 base and wheel, in a cache of this test session's
    (a shared clone of the tool's cache repo, the wheel linked), and a
    project with a one-patch stack on it."""
    tmp = tmp_path_factory.mktemp("real")
    env = dict(os.environ, VLLM_PATCHES_OFFLINE="1")
    env.pop("VLLM_REPO", None)
    proj = tmp / "proj"
    (proj / "tests" / "patches").mkdir(parents=True)
    (proj / "series").write_text(
        "#@ stack tq repo=https://github.com/vllm-project/vllm tag=v0.20.2 "
        f"commit={PIN}\n")
    p = subprocess.run([PY, str(APPLY), "base", "--series", str(proj / "series")],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr
    rev, commit, repo = p.stdout.split()[:3]
    repo = Path(repo.split("=", 1)[1])
    cache = tmp / "cache"
    (cache / "dist").mkdir(parents=True)
    git("clone", "-q", "--bare", "--shared", str(repo), str(cache / "vllm.git"),
        cwd=tmp)
    for w in (repo.parent / "dist").glob("vllm-0.20.2-*.whl"):
        (cache / "dist" / w.name).symlink_to(w)
    # the fixture patch, made on a clone of that base
    work = tmp / "work"
    git("clone", "-q", "--no-checkout", str(repo), str(work), cwd=tmp)
    git("checkout", "-q", "--detach", commit, cwd=work)
    f = work / TQ
    text = f.read_text()
    anchor = "_CONTINUATION_DECODE_THRESHOLD = 128\n"
    assert anchor in text
    f.write_text(text.replace(anchor, anchor + TQ_MARK))
    (work / REAL_NEW).write_text(NEW_PY)
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m",
        "[Attention][TurboQuant] Mark the module\n\nWhy.\n\n"
        "Bug: https://github.com/vllm-project/vllm/issues/41726\n"
        "Upstream-Status: Inappropriate [fixture]\n"
        "Tests: tests/patches/test_tq_marker.py::test_marker_regression\n"
        + SOB, cwd=work)
    (proj / "patches" / "tq").mkdir(parents=True)
    p = subprocess.run([PY, str(APPLY), "format-patch", "--repo", str(work),
                        "HEAD", "--out",
                        str(proj / "patches" / "tq" / "0001-mark.patch")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    with (proj / "series").open("a") as fh:
        fh.write("tq/0001-mark.patch\n")
    (proj / "tests" / "patches" / "test_tq_marker.py").write_text(REAL_TEST)
    return {"tmp": tmp, "proj": proj, "cache": cache, "commit": commit,
            "work": work, "official": sorted((cache / "dist").glob("*.whl"))}


@pytest.fixture(scope="session")
def real_wheel(real: dict) -> dict:
    out = real["tmp"] / "out"
    t0 = time.monotonic()
    p = run_tool("wheel", "--series", str(real["proj"] / "series"), "--out",
                 str(out), "--json", str(real["tmp"] / "wheel.json"),
                 cache=real["cache"], cwd=real["tmp"])
    seconds = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((real["tmp"] / "wheel.json").read_text())
    print(f"\nreal wheel: {p.stdout.strip()}\n(apply.py wheel took {seconds:.1f}"
          " s end to end)")
    return {**rep, "stdout": p.stdout, "path": Path(rep["wheel"])}


def test_real_wheel(real: dict, real_wheel: dict) -> None:
    official = Path(real_wheel["from_wheel"])
    assert official.name == "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl"
    local = "tq." + digest(real["proj"] / "series", ["tq/0001-mark.patch"])[:8]
    version = f"0.20.2+{local}"
    whl = real_wheel["path"]
    assert whl.name == f"vllm-{version}-cp38-abi3-manylinux_2_35_x86_64.whl"
    assert real_wheel["files"] == {TQ: "M", REAL_NEW: "A"}
    assert real_wheel["notes"] == []
    hashes = verify_record(whl)  # every entry of the output's RECORD
    with zipfile.ZipFile(official) as zf:
        info = "vllm-0.20.2.dist-info"
        rows = csv.reader(io.TextIOWrapper(zf.open(f"{info}/RECORD"),
                                           encoding="utf-8"))
        want = {r[0]: r[1] for r in rows if not r[0].startswith(info)}
    same = {p for p in want if p not in (TQ, "vllm/_version.py")}
    assert len(same) > 3000
    for path in same:
        assert hashes[path] == want[path], path
    patched = subprocess.run(["git", "show", f"HEAD:{TQ}"], cwd=real["work"],
                             capture_output=True, check=True).stdout
    assert hashes[TQ] == record_b64(patched)
    assert hashes[REAL_NEW] == record_b64(NEW_PY.encode())
    assert {p for p in hashes if not p.startswith(f"vllm-{version}.dist-info/")} \
        == set(want) | {REAL_NEW}


# --------------------------------------------------------------------------
# the serving image's recipe (built for real with buildah: test_image.py)


def dockerfile() -> tuple[dict[str, str], str, list[list[str]], list[str]]:
    """ARG defaults, FROM, COPY argument lists and RUN commands."""
    text = (ROOT / "ci" / "Dockerfile.serving").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(
        ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    args, frm, copies, runs = {}, "", [], []
    for ln in text.splitlines():
        word, _, rest = ln.strip().partition(" ")
        if word == "ARG":
            k, _, v = rest.partition("=")
            args[k] = v
        elif word == "FROM":
            frm = rest
        elif word == "COPY":
            copies.append(rest.split())
        elif word == "RUN":
            runs.append(rest.strip())
        elif word:
            raise AssertionError(f"unexpected instruction {word}")
    return args, frm, copies, runs


def expand(s: str, args: dict[str, str]) -> str:
    while "${" in s:
        s = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s)
    return s


def docker_ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching (patterns match a path or a parent)."""
    def rx(p: str) -> re.Pattern:
        out = ""
        for part in re.split(r"(\*\*|\*|\?)", p.strip("/")):
            out += {"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part,
                                                             re.escape(part))
        return re.compile(out + "(/.*)?$")
    ignored = False
    for p in patterns:
        neg = p.startswith("!")
        if rx(p[1:] if neg else p).match(rel):
            ignored = not neg
    return ignored


def test_dockerfile_context(tmp_path: Path) -> None:
    args, frm, copies, runs = dockerfile()
    assert expand(frm, args) == "vllm/vllm-openai:v0.33.0"
    series = (ROOT / "series").read_text()
    assert "tag=v" + args["VLLM_RELEASE"] in series
    patterns = [ln.strip() for ln in (ROOT / "ci" / "Dockerfile.serving."
                                      "dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    files = ["apply.py", "series", "patches/tq/0001-x.patch", ".venv/bin/python",
             "ci/test.sh", "ci/image-smoke.py", "ci/Dockerfile.serving",
             "dist/vllm-0.20.2+tq.1a2b3c4d-cp38-abi3-manylinux_2_35_x86_64.whl",
             "dist/notes.txt", "tests/tool/conftest.py", "build/x",
             "applylib/cli.py", "applylib/__pycache__/cli.cpython-311.pyc",
             "README.md", "tests/patches/test_tq_hybrid.py"]
    sent = [f for f in files if not docker_ignored(f, patterns)]
    assert sorted(sent) == [
        "apply.py", "applylib/cli.py", "ci/image-smoke.py",
        "dist/vllm-0.20.2+tq.1a2b3c4d-cp38-abi3-manylinux_2_35_x86_64.whl",
        "patches/tq/0001-x.patch", "series"]
    assert copies == [["${WHEEL}", "${STAGE}/"],
                      ["apply.py", "series", "${STAGE}/project/"],
                      ["applylib/", "${STAGE}/project/applylib/"],
                      ["patches/", "${STAGE}/project/patches/"],
                      ["ci/image-smoke.py", "${STAGE}/project/ci/"]]
    # what the smoke check runs is in the context
    for path in ("apply.py", "series", "ci/image-smoke.py"):
        assert not docker_ignored(path, patterns) and (ROOT / path).is_file()
    for f in (ROOT / "applylib").glob("*.py"):
        assert not docker_ignored(f"applylib/{f.name}", patterns)
    assert len(runs) == 1 and "pip install --no-deps" in runs[0]
    # the image's vllm is checked before the wheel replaces it
    assert runs[0].index("image-smoke.py\" --base") < runs[0].index("pip install")


# --------------------------------------------------------------------------
# export on the real base


def test_real_export(real: dict, tmp_path: Path) -> None:
    # a user's vLLM repository with v0.20.2 (a clone of the cache's)
    user = tmp_path / "vllm"
    git("clone", "-q", "--no-checkout", "--shared", str(real["cache"] /
                                                         "vllm.git"), str(user),
        cwd=tmp_path)
    git("checkout", "-q", "-b", "main", "v0.20.2", cwd=user)
    head = git("rev-parse", "HEAD", cwd=user)
    series = str(real["proj"] / "series")
    p = run_tool("export", "tq/0001-mark.patch", "--series", series, "--repo",
                 str(user), cache=tmp_path / "cache", cwd=tmp_path,
                 env=submitter(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    ref = "refs/heads/patched/pr/tq-0001-mark"
    assert git("rev-parse", f"{ref}^", cwd=user) == real["commit"]
    assert git("rev-list", "--count", f"v0.20.2..{ref}", cwd=user) == "1"
    assert sorted(git("diff", "--name-only", "v0.20.2", ref, cwd=user).split()) \
        == sorted([TQ, REAL_NEW, "tests/v1/attention/test_tq_marker.py"])
    test = git("show", f"{ref}:tests/v1/attention/test_tq_marker.py", cwd=user)
    assert "def vllm_tree() -> Path:" in test
    assert git("rev-parse", "HEAD", cwd=user) == head
    assert git("status", "--porcelain", cwd=user) == ""
    am_round_trip(user, ref, real["commit"], tmp_path)
    # with no repository: the tool's cache, and a note on what that base is
    p = run_tool("export", "0001", "--series", series, cache=real["cache"],
                 cwd=real["tmp"], env=submitter(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "is the tool's cache: its v0.20.2 is the release's Python sources" \
        in p.stdout
    # its patch file carries the commit into the user's clone
    pf = Path(re.search(r"am -k (\S+)", p.stdout).group(1))
    am_round_trip(user, ref, real["commit"], tmp_path, pf)
    assert git("rev-parse", f"{ref}^", cwd=real["cache"] / "vllm.git") == \
        real["commit"]
    # the same patch on the same base with the same identity: the same commit
    assert git("rev-parse", ref, cwd=real["cache"] / "vllm.git") == \
        git("rev-parse", ref, cwd=user)


def test_real_series_exports(tmp_path: Path) -> None:
    """Each TurboQuant patch of the project's own series exports on its
    stack's base: one commit, its test added, signed off by the submitter,
    and a PR text that names neither this project's paths nor its series
    (export exits 1 on one that does)."""
    from applylib.export import export_stem
    from applylib.series import parse_series

    series = ROOT / "series"
    stacks = [s for s in parse_series(series).stacks if s.name in ("tq", "tq-v0.33")]
    env = dict(os.environ, VLLM_PATCHES_OFFLINE="1")
    for stack in stacks:
        p = subprocess.run([PY, str(APPLY), "base", "--stack", stack.name],
                           env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, p.stderr
        repo = p.stdout.split()[2].split("=", 1)[1]
        user = tmp_path / stack.name
        git("clone", "-q", "--bare", "--shared", repo, str(user), cwd=tmp_path)
        for entry in stack.patches:
            r = run_tool("export", entry, "--repo", str(user), "--series",
                         str(series), cache=tmp_path / "cache", cwd=tmp_path,
                         env=submitter(tmp_path))
            assert r.returncode == 0, r.stdout + r.stderr
            ref = f"refs/heads/patched/pr/{export_stem(parse_series(series), entry)}"
            parent = git("rev-parse", f"{ref}^", cwd=user)
            assert git("rev-list", "--count", f"{parent}..{ref}", cwd=user) == "1"
            added = git("diff", "--name-only", "--diff-filter=A", parent, ref,
                        cwd=user).split()
            assert any(a.startswith("tests/") and a.endswith(".py") for a in added)
            msg = git("log", "-1", "--format=%B", ref, cwd=user)
            assert msg.count("Signed-off-by:") == 1 and "Jane Dev" in msg
            am_round_trip(user, ref, parent, tmp_path)


def test_backport_keeps_its_author_and_sign_off() -> None:
    """A backport's PR commit keeps the original author's sign-off; the
    series' identity signs nothing off and, as the adaptation's co-author,
    stands for the submitter (the dsv4 patches' own trailers)."""
    from applylib.prtext import pr_trailers
    from applylib.series import load_patch, parse_series

    series = parse_series(ROOT / "series")
    patch = load_patch(series, "dsv4/0002-rocm-dsv4-compressor-first-token-rope.patch")
    assert "\nFrom: Chuan Li <chuali@amd.com>\n" in patch.raw.decode()
    got = pr_trailers(patch.trailers, ("Jane Dev", "jane@example.com"))
    assert [(k, v) for k, v in got if k in ("Co-authored-by", "Signed-off-by")] == [
        ("Co-authored-by", "Jane Dev <jane@example.com>"),
        ("Signed-off-by", "Chuan Li <chuali@amd.com>"),
        ("Signed-off-by", "Jane Dev <jane@example.com>"),
    ]


def test_pr_text_of_a_patch_with_its_own_test_is_the_change_alone() -> None:
    """Each tq-v0.33 patch keeps its own test for vLLM: its PR text leaves
    out the message's plan and result (about the series' tests) and its
    "This patch can be dropped once ..." sentences, and names nothing of
    this project (export's lint, on the real messages)."""
    from applylib.prtext import WHEN_TO_DROP, pr_message, series_words
    from applylib.series import load_patch, parse_series

    series = parse_series(ROOT / "series")
    (stack,) = [s for s in series.stacks if s.name == "tq-v0.33"]
    for entry in stack.patches:
        assert list((ROOT / "tests/upstream/tq-v0.33").glob(
            entry.split("/")[1].removesuffix(".patch") + "/tests/**/test_*.py"))
        patch = load_patch(series, entry)
        assert WHEN_TO_DROP.search(patch.body), entry
        _, body, dropped = pr_message(
            patch, f"{patch.subject}\n\n{patch.body}", ["tests/t.py"], None,
            ("Jane Dev", "jane@example.com"), [], {}, kept_test=True)
        assert dropped == ["When to drop", "Test plan", "Test result"], entry
        assert "can be dropped" not in body and "tests/patches" not in body
        assert series_words(body) == [], entry


# the patches whose exported tests CI runs under plain pytest: one of the
# v0.20.2 stack (the adapted series test), and tq-v0.33's with their own
# tests for vLLM: tests only, for a fix another PR carries (0003), a config
# test (0008) and a count of the decode's loads in Triton's interpreter
# (0009)
PLAIN_IN_CI = ["tq/0003", "tq-v0.33/0003", "tq-v0.33/0008", "tq-v0.33/0009"]
# (not tq-v0.33/0004, 0005, 0007 and 0010: their own tests for vLLM need a
# GPU, proven on one in ci/gpu/results/kept-tests-2026-12-02 and -02b)
PLAIN_ALL = [f"tq/000{i}" for i in range(1, 6)] + [
    f"tq-v0.33/000{i}" for i in (1, 2, 3, 8, 9)]


def plain_export(entry: str, tmp_path: Path) -> None:
    """export --run-tests of one patch of the real series on its stack's
    base: its test fails before the change and passes with it under plain
    pytest in vLLM's tree (export exits 1 otherwise)."""
    stack = entry.split("/")[0]
    env = dict(os.environ, VLLM_PATCHES_OFFLINE="1")
    p = subprocess.run([PY, str(APPLY), "base", "--stack", stack], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr
    user = tmp_path / stack
    if not user.exists():
        repo = p.stdout.split()[2].split("=", 1)[1]
        git("clone", "-q", "--bare", "--shared", repo, str(user), cwd=tmp_path)
    r = run_tool("export", entry, "--repo", str(user), "--run-tests",
                 cache=tmp_path / "cache", cwd=tmp_path, env=submitter(tmp_path),
                 timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| `")]
    assert rows and all(ln.endswith("| failed | passed |") for ln in rows), rows
    kept = [f.relative_to(d).as_posix()
            for d in (ROOT / "tests/upstream" / stack).glob(
                entry.split("/")[1] + "-*/")
            for f in sorted(d.rglob("*.py"))]
    if kept:  # its own test for vLLM, alone: nothing of the series' tests
        assert rows == [f"| `{f}` | failed | passed |" for f in kept], rows


@pytest.mark.parametrize("entry", PLAIN_IN_CI)
def test_real_exports_run_under_plain_pytest(entry: str, tmp_path: Path) -> None:
    plain_export(entry, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in PLAIN_ALL if e not in PLAIN_IN_CI])
def test_real_exports_run_under_plain_pytest_all(entry: str, tmp_path: Path) -> None:
    plain_export(entry, tmp_path)

