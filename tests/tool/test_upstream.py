"""apply.py upstream: vLLM's own tests of the modules a stack changes, on the
base and patched; a test the base passes and the stack breaks is exit 1
unless the patch carries its update (tests/upstream/<stack>/<patch>.diff).
The tests come from the clone's tests/ or, for a release base, its sdist."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from conftest import MOD_V1, MOD_V11, Fixture, git, make_upstream, standard_stack

# vLLM's own test of vllm/mod.py: it pins scale()'s old behaviour, which
# fx/0002 changes on purpose; threshold() no patch touches.
UPSTREAM_TEST = """\
from vllm import mod


def test_scale():
    assert mod.scale(2) == 4


def test_threshold():
    assert mod.threshold() == 128
"""
UPDATE = """\
diff --git a/tests/test_mod.py b/tests/test_mod.py
--- a/tests/test_mod.py
+++ b/tests/test_mod.py
@@ -2,7 +2,7 @@ from vllm import mod
 
 
-def test_scale():
-    assert mod.scale(2) == 4
+def test_scale_is_identity():
+    assert mod.scale(2) == 2
 
 
 def test_threshold():
"""


@pytest.fixture
def ux(tmp_path: Path, fx: Fixture) -> Fixture:
    """The standard stack on an upstream whose v1.0.0 has vLLM's tests/."""
    files = {"vllm/__init__.py": "", "vllm/mod.py": MOD_V1,
             "tests/test_mod.py": UPSTREAM_TEST}
    fx.upstream = make_upstream(tmp_path / "upstream-with-tests", files, MOD_V11)
    standard_stack(fx)
    return fx


def test_upstream_test_broken_unless_the_patch_updates_it(ux: Fixture) -> None:
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "fx: vLLM's tests of the modules its patches change (the tests of " \
        "v1.0.0 in" in p.stdout
    assert "  tests/test_mod.py\n" in p.stdout
    assert "  REGRESSION tests/test_mod.py::test_scale: passed on the base, " \
        "failed patched\n" in p.stdout
    assert "test_threshold" not in p.stdout  # passes on both
    update = ux.project / "tests" / "upstream" / "fx" / "0002-fix-scale.diff"
    update.parent.mkdir(parents=True)
    update.write_text(UPDATE)
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  with the update tests/upstream/fx/0002-fix-scale.diff\n" \
        "  base: 2 passed\n  patched: 2 passed\n" \
        "  updated tests/test_mod.py::test_scale: renamed or removed by the " \
        "update\n" in p.stdout
    # export carries the update in the PR, where the tree has vLLM's tests
    p = ux.run("export", "0002", "--repo", str(ux.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  upstream tests: tests/upstream/fx/0002-fix-scale.diff applied" \
        in p.stdout
    ref = "refs/heads/patched/pr/fx-0002-fix-scale"
    assert "tests/test_mod.py" in git("diff", "--name-only", f"{ref}^", ref,
                                      cwd=ux.upstream).split()
    # an update that does not apply to vLLM's tests is bad input
    update.write_text(UPDATE.replace("== 4", "== 5"))
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 2 and "does not apply to vLLM's tests" in p.stderr
    p = ux.run("upstream", "nope", "--repo", str(ux.upstream))
    assert p.returncode == 2 and "no stack named nope" in p.stderr


KEPT = """\
from vllm import mod


def test_scale_keeps_its_argument():
    assert mod.scale(2) == 2
"""


def test_kept_test_fails_on_the_base_and_passes_patched(ux: Fixture) -> None:
    """A patch's own test for vLLM (tests/upstream/<stack>/<patch>/, files
    at their vLLM paths) runs in both trees beside vLLM's tests: proven
    when it fails on the base and passes patched; exit 1 when it does not
    (a test that passes on the base proves nothing)."""
    update = ux.project / "tests" / "upstream" / "fx" / "0002-fix-scale.diff"
    update.parent.mkdir(parents=True)
    update.write_text(UPDATE)
    kept = ux.project / "tests/upstream/fx/0002-fix-scale/tests/test_scale_kept.py"
    kept.parent.mkdir(parents=True)
    kept.write_text(KEPT)
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  base: 2 passed\n  patched: 2 passed\n" in p.stdout
    assert "  kept tests/test_scale_kept.py (fx/0002-fix-scale.patch): failed " \
        "on the base, passed patched\n" in p.stdout
    kept.write_text(KEPT.replace("== 2", "> 0"))
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "  NOT PROVEN tests/test_scale_kept.py (fx/0002-fix-scale.patch): " \
        "passed on the base, passed patched\n" in p.stdout
    # skipped whole on this host: not run, and pytest's reason said
    kept.write_text("import pytest\n\npytestmark = pytest.mark.skip("
                    "reason=\"needs a GPU\")\n\n" + KEPT)
    p = ux.run("upstream", "fx", "--repo", str(ux.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  kept tests/test_scale_kept.py (fx/0002-fix-scale.patch): not run " \
        "here, skipped (needs a GPU)\n" in p.stdout
    assert "  base: 2 passed\n  patched: 2 passed\n" in p.stdout


def sdist(folder: Path, version: str, files: dict[str, str]) -> Path:
    """A stand-in vllm-VERSION.tar.gz holding `files` under its top folder."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"vllm-{version}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_release_tests_from_the_sdist(tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A release's tests/ come from its sdist on the index (a find-links
    folder here, or a simple page whose sha256 must match), once: the
    cache serves them after; no sdist is a base that cannot be had."""
    from applylib import sdist as sd
    from applylib.bases import BaseUnavailable

    monkeypatch.setenv("VLLM_PATCHES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    archive = sdist(tmp_path / "links", "9.9.9", {
        "tests/test_x.py": "def test_x():\n    pass\n",
        "vllm/__init__.py": "", "../evil.py": "no"})
    monkeypatch.setenv("PIP_FIND_LINKS", str(archive.parent))
    tests = sd.release_tests("9.9.9")
    assert sorted(p.name for p in tests.rglob("*")) == ["test_x.py"]
    archive.unlink()
    assert sd.release_tests("9.9.9") == tests  # cached
    page = tmp_path / "simple" / "index.html"
    page.parent.mkdir()
    other = sdist(tmp_path / "files", "9.9.8", {"tests/test_y.py": ""})
    page.write_text(f'<a href="{other.as_uri()}#sha256={"0" * 64}">x</a>')
    monkeypatch.setenv("PIP_FIND_LINKS", str(page))
    with pytest.raises(BaseUnavailable, match="sha256 differs"):
        sd.release_tests("9.9.8")
    monkeypatch.setenv("PIP_FIND_LINKS", os.devnull)
    with pytest.raises(BaseUnavailable, match="source distribution is not"):
        sd.release_tests("9.9.7")


def test_export_onto_carries_the_update_of_vllm_tests(fx: Fixture) -> None:
    """export --onto a commit that has vLLM's tests/ (main, in real use)
    when the stack's base has none (a release's wheel): the patch's update
    of vLLM's tests is carried into the PR there, and the report names
    that commit as the parent. (Before, the update stayed out: vLLM's CI
    would fail the tests it updates.)"""
    standard_stack(fx)
    update = fx.project / "tests" / "upstream" / "fx" / "0002-fix-scale.diff"
    update.parent.mkdir(parents=True)
    update.write_text(UPDATE)
    work = fx.tmp / "main-with-tests"
    git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "tests").mkdir()
    (work / "tests" / "test_mod.py").write_text(UPSTREAM_TEST)
    git("add", "tests", cwd=work)
    git("commit", "-q", "-m", "vLLM's tests", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/heads/main2", cwd=work)
    main2 = git("rev-parse", "HEAD", cwd=work)
    p = fx.run("export", "0002", "--repo", str(fx.upstream), "--onto", "main2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  upstream tests: tests/upstream/fx/0002-fix-scale.diff applied" \
        in p.stdout, p.stdout
    assert f"  parent: main2 ({main2[:12]})\n" in p.stdout, p.stdout
    ref = "refs/heads/patched/pr/fx-0002-fix-scale"
    assert git("rev-parse", f"{ref}^", cwd=fx.upstream) == main2
    test = git("show", f"{ref}:tests/test_mod.py", cwd=fx.upstream)
    assert "def test_scale_is_identity" in test, test
