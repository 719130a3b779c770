"""Verdicts: a regression test counts as the bug only when it fails with the
bug's signature; anything else that goes wrong is "error" (cannot tell),
never "fail" and never "pass". Each patch is judged at its own position in
the series, and the tree under test is the only vLLM its processes see."""

from __future__ import annotations

import pytest

from conftest import (
    FIXED_ADD,
    MOD_V1,
    REG_SCALE,
    Fixture,
    git,
    standard_stack,
)


def rows(fx: Fixture, out) -> dict[str, dict]:
    return {p["file"]: p for p in fx.report(out)["stacks"][0]["patches"]}


def scale_test(body: str, header: str = "") -> str:
    return (
        "import pytest\n" + header + "\n\n"
        '@pytest.mark.bug_signature(AssertionError, r"^scale is wrong")\n'
        "def test_scale_regression():\n"
        "    import vllm.mod as m\n" + "".join(f"    {ln}\n" for ln in body.split("\n"))
    )


def run_main(fx: Fixture, *extra: str, env: dict[str, str] | None = None):
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out), *extra, env=env)
    return p, rows(fx, out)


def test_fail_only_with_the_signature(fx: Fixture) -> None:
    standard_stack(fx)
    p, r = run_main(fx)
    assert p.returncode == 0, p.stdout + p.stderr
    add = r["fx/0001-fix-add.patch"]
    assert add["regression"] == {"base": "fail", "patched": "pass"}
    got = add["test_outcomes"]["base"]["tests/patches/test_add.py::test_add_regression"]
    assert got["verdict"] == "fail"
    assert got["reason"].startswith("AssertionError: add is wrong")
    assert "regression base: AssertionError: add is wrong" in p.stdout


def test_other_failure_is_error_not_fail(fx: Fixture) -> None:
    """API drift (an AttributeError) and an assertion that is not the bug's
    signature both say nothing about the bug."""
    standard_stack(fx)
    tests = fx.project / "tests" / "patches" / "test_scale.py"
    for body, why in (
        ("m.scale_v2(5)", "AttributeError: module 'vllm.mod' has no attribute"),
        ('assert False, "unrelated"', "not the bug's signature: AssertionError: "),
    ):
        tests.write_text(scale_test(body))
        p, r = run_main(fx)
        assert p.returncode == 1, p.stdout
        scale = r["fx/0002-fix-scale.patch"]
        assert scale["regression"]["base"] == "error"
        assert why in scale["reasons"]["regression_base"]
        assert why in p.stdout
        assert r["fx/0001-fix-add.patch"]["regression"]["base"] == "fail"


def test_import_error_is_error(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_scale.py").write_text(
        scale_test("assert m.scale(5) == 5", "import vllm.gone  # noqa: F401")
    )
    p, r = run_main(fx)
    assert p.returncode == 1
    scale = r["fx/0002-fix-scale.patch"]
    assert scale["regression"] == {"base": "error", "patched": "error"}
    assert "ModuleNotFoundError" in scale["reasons"]["regression_base"]


def test_timeout_is_error(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_scale.py").write_text(
        scale_test("import time\ntime.sleep(60)")
    )
    p, r = run_main(fx, env={"VLLM_PATCHES_TEST_TIMEOUT": "2"})
    assert p.returncode == 1
    scale = r["fx/0002-fix-scale.patch"]
    assert scale["regression"]["base"] == "error"
    assert "timed out after 2 s" in scale["reasons"]["regression_base"]


def test_skipped_regression_test_is_not_a_pass(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_scale.py").write_text(
        scale_test('pytest.skip("not here")')
    )
    p, r = run_main(fx)
    assert p.returncode == 1
    assert r["fx/0002-fix-scale.patch"]["regression"] == {
        "base": "skip",
        "patched": "skip",
    }


@pytest.mark.parametrize("marked", [True, False])
def test_skip_for_another_tree_is_not_a_missing_verdict(
    fx: Fixture, marked: bool
) -> None:
    """A patch's other test that compares what only some trees have
    (marker ``some_trees``) and skips on this one leaves the patch's tests a
    pass; an unmarked skip leaves them a skip, and the run is not OK."""
    standard_stack(fx)
    mark = "@pytest.mark.some_trees\n" if marked else ""
    tests = fx.project / "tests" / "patches" / "test_add.py"
    tests.write_text(
        tests.read_text()
        + f'\n\n{mark}def test_old_api():\n    pytest.skip("no old API here")\n'
    )
    p, r = run_main(fx)
    add = r["fx/0001-fix-add.patch"]
    assert add["regression"] == {"base": "fail", "patched": "pass"}
    assert add["tests"] == ("pass" if marked else "skip")
    assert add["skipped"] == 1
    assert p.returncode == (0 if marked else 1), p.stdout


def test_patch_judged_at_its_position(fx: Fixture) -> None:
    """0002 fixes a function 0001 introduces: its regression test cannot even
    run on the bare base, and fails with its signature on base + 0001. The
    tests with 0002 see base + 0001 as VLLM_BASE_TREE."""
    with_mul = FIXED_ADD + "\n\ndef mul(a, b):\n    return a + b  # bug\n"
    fx.make_patch(
        "fx/0001-add-mul.patch",
        {"vllm/mod.py": with_mul},
        "[Core] Fix add, add mul",
        ["tests/patches/test_add.py::test_add_regression"],
        base="v1.0.0",
    )
    fx.make_patch(
        "fx/0002-fix-mul.patch",
        {"vllm/mod.py": with_mul.replace("a + b  # bug", "a * b")},
        "[Core] Fix mul",
        [
            "tests/patches/test_mul.py::test_mul_regression",
            "tests/patches/test_mul.py::test_base_tree_is_the_tree_before",
        ],
    )
    (fx.project / "tests" / "patches" / "test_mul.py").write_text(
        "import os\nfrom pathlib import Path\n\nimport pytest\n\n\n"
        '@pytest.mark.bug_signature(AssertionError, r"^mul adds")\n'
        "def test_mul_regression():\n"
        "    import vllm.mod as m\n"
        '    assert m.mul(2, 3) == 6, "mul adds"\n\n\n'
        "def test_base_tree_is_the_tree_before():\n"
        '    base = Path(os.environ["VLLM_BASE_TREE"]) / "vllm" / "mod.py"\n'
        '    assert "return a + b  # bug" in base.read_text()\n'
        '    assert "return a + b\\n" in base.read_text()\n'
    )
    fx.write_series(
        "#@ stack fx repo=https://example.invalid/vllm tag=v1.0.0\n"
        "fx/0001-add-mul.patch\nfx/0002-fix-mul.patch\n"
    )
    p, r = run_main(fx)
    assert p.returncode == 0, p.stdout + p.stderr
    mul = r["fx/0002-fix-mul.patch"]
    assert mul["regression"] == {"base": "fail", "patched": "pass"}
    assert mul["tests"] == "pass"


@pytest.mark.parametrize("jobs", [1, 2])
def test_every_position_sees_its_own_trees_in_two_worktrees_a_lane(
    fx: Fixture, jobs: int
) -> None:
    """Four patches, each raising LEVEL by one: the tests at every position
    see that position's tree as VLLM_TREE and the one before it as
    VLLM_BASE_TREE, although two worktrees per lane serve all four
    positions, with one lane or two side by side."""
    (fx.project / "tests" / "patches" / "test_level.py").write_text(
        "import os\nfrom pathlib import Path\n\nimport pytest\n\n\n"
        "def level(var):\n"
        '    text = (Path(os.environ[var]) / "vllm" / "mod.py").read_text()\n'
        '    return int(text.rsplit("LEVEL = ", 1)[1]) if "LEVEL" in text else 0\n\n\n'
        '@pytest.mark.parametrize("k", [1, 2, 3, 4])\n'
        '@pytest.mark.bug_signature(AssertionError, r"^below the fix")\n'
        "def test_level(k):\n"
        '    assert level("VLLM_TREE") >= k, "below the fix"\n'
        '    before = level("VLLM_TREE") - 1\n'
        '    assert level("VLLM_BASE_TREE") == before, "base tree not the one before"\n'
    )
    text, series = MOD_V1, "#@ stack fx repo=https://example.invalid/vllm tag=v1.0.0\n"
    for k in range(1, 5):
        text += f"\nLEVEL = {k}\n"
        name = f"fx/000{k}-level-{k}.patch"
        fx.make_patch(name, {"vllm/mod.py": text}, f"[Core] Level {k}",
                      [f"tests/patches/test_level.py::test_level[{k}]"],
                      base="v1.0.0" if k == 1 else None)
        series += name + "\n"
    fx.write_series(series)
    p, r = run_main(fx, env={"VLLM_PATCHES_JOBS": str(jobs)})
    assert p.returncode == 0, p.stdout + p.stderr
    for k in range(1, 5):
        assert r[f"fx/000{k}-level-{k}.patch"]["regression"] == {
            "base": "fail", "patched": "pass"}
    trees = {d.name for d in fx.cache.glob("worktrees/*/fx-at-*")}
    # Only the lanes' own trees (lane i: 2i and 2i+1). Which lane ran what
    # varies, but positions 1-3 each need two trees other than the top, so
    # the lane that ran one of them made both of its own.
    lanes = [{f"fx-at-{2 * i}", f"fx-at-{2 * i + 1}"} for i in range(jobs)]
    assert trees <= set().union(*lanes), trees
    assert any(lane <= trees for lane in lanes), trees


def test_stacks_share_the_lanes(fx: Fixture) -> None:
    """Two stacks of one patch each, two lanes: the second stack's runs
    start while the first stack's are still going (no lane idles at the
    end of a stack). The first stack's patched run waits for one of the
    second stack's runs to have started; run one stack after the other it
    would wait in vain."""
    started = fx.tmp / "fy-started"
    (fx.project / "tests" / "patches" / "test_both.py").write_text(
        "import os, time\n\nimport pytest\n\n\n"
        '@pytest.mark.bug_signature(AssertionError, r"^add is wrong")\n'
        "def test_both():\n"
        "    import vllm.mod as m\n\n"
        '    if "/fy-" in os.environ["VLLM_TREE"]:\n'
        f"        open({str(started)!r}, 'w').close()\n"
        "    elif m.add(1, 1) == 2:\n"
        "        end = time.monotonic() + 60\n"
        f"        while not os.path.exists({str(started)!r}):\n"
        '            assert time.monotonic() < end, "stack fy did not start"\n'
        "            time.sleep(0.1)\n"
        '    assert m.add(1, 1) == 2, "add is wrong"\n'
    )
    series = ""
    for name in ("fx", "fy"):
        fx.make_patch(f"{name}/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                      "[Core] Fix add", ["tests/patches/test_both.py::test_both"],
                      base="v1.0.0")
        series += (f"#@ stack {name} repo=https://example.invalid/vllm "
                   f"tag=v1.0.0\n{name}/0001-fix-add.patch\n")
    fx.write_series(series)
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out),
               env={"VLLM_PATCHES_JOBS": "2"})
    assert p.returncode == 0, p.stdout + p.stderr
    for st in fx.report(out)["stacks"]:
        assert st["patches"][0]["regression"] == {"base": "fail", "patched": "pass"}


def test_expected_failure_is_not_shrunk(fx: Fixture) -> None:
    """A generated regression test fails on the base: its first failing
    example is the verdict (shrinking it cost minutes per test in CI), with
    its signature; patched it passes, and every example runs."""
    calls = fx.tmp / "calls"
    (fx.project / "tests" / "patches" / "test_gen.py").write_text(
        "import pytest\nfrom hypothesis import given, settings\n"
        "from hypothesis import strategies as st\n\n\n"
        "@settings(max_examples=30, derandomize=True, database=None)\n"
        "@given(st.lists(st.integers(0, 10**6), min_size=8))\n"
        '@pytest.mark.bug_signature(AssertionError, r"^add is wrong")\n'
        "def test_gen(xs):\n"
        "    import vllm.mod as m\n\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write('b' if m.add(1, 1) != 2 else 'p')\n"
        "    assert m.add(sum(xs), 1) == sum(xs) + 1, 'add is wrong'\n"
    )
    fx.make_patch("fx/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                  "[Core] Fix add", ["tests/patches/test_gen.py::test_gen"],
                  base="v1.0.0")
    fx.write_series("#@ stack fx repo=https://example.invalid/vllm tag=v1.0.0\n"
                    "fx/0001-fix-add.patch\n")
    p, r = run_main(fx)
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["fx/0001-fix-add.patch"]["regression"] == {
        "base": "fail", "patched": "pass"}
    # base: the failing example and its replay (shrinking takes dozens);
    # patched: every example
    ran = calls.read_text()
    assert ran.count("b") <= 3 and ran.count("p") == 30, ran


def test_later_patch_undoing_a_fix_fails_the_stack(fx: Fixture) -> None:
    standard_stack(fx)
    # 0002 fixes scale but puts add's bug back
    fx.make_patch(
        "fx/0002-fix-scale.patch",
        {"vllm/mod.py": MOD_V1.replace("return x * 2", "return x * 1")},
        "[Core] Fix scale",
        [REG_SCALE],
        base="HEAD~1",
    )
    p, r = run_main(fx)
    assert p.returncode == 1
    add = r["fx/0001-fix-add.patch"]
    assert add["regression"]["patched"] == "fail"
    stack = add["test_outcomes"]["stack"]
    assert stack["tests/patches/test_add.py::test_add_regression"]["verdict"] == "fail"
    assert r["fx/0002-fix-scale.patch"]["regression"]["patched"] == "pass"


def test_already_applied_patch_is_not_needed(fx: Fixture) -> None:
    """A base that holds 0002 word for word: git am -3 says "No changes" and
    makes no commit; the patch goes to the not-needed check, not to 3way."""
    standard_stack(fx)
    work = fx.tmp / "work"
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "vllm" / "mod.py").write_text(
        MOD_V1.replace("return x * 2", "return x * 1")
    )
    git("commit", "-q", "-am", "scale fixed upstream", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/tags/v1.0.1", cwd=work)
    p, r = run_main(fx, "--base", "v1.0.1")
    assert p.returncode == 0, p.stdout + p.stderr
    scale = r["fx/0002-fix-scale.patch"]
    assert scale["apply"] == "not-needed"
    assert scale["detail"].startswith("already in the base")
    assert r["fx/0001-fix-add.patch"]["apply"] == "clean"


def test_tree_is_the_only_vllm_and_caches_are_private(fx: Fixture) -> None:
    """A subprocess started by a test imports the tree under test, with
    vLLM's and Triton's caches in a folder of the run's own."""
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_env.py").write_text(
        "import os, subprocess, sys\nfrom pathlib import Path\n\n\n"
        "def test_env():\n"
        "    out = subprocess.run([sys.executable, '-c', 'import vllm.mod; "
        "print(vllm.mod.__file__)'], capture_output=True, text=True, "
        "env={k: v for k, v in os.environ.items() if k != 'VLLM_TREE'})\n"
        "    tree = Path(os.environ['VLLM_TREE']).resolve()\n"
        "    assert tree in Path(out.stdout.strip()).resolve().parents, out\n"
        "    for var in ('VLLM_CACHE_ROOT', 'TRITON_CACHE_DIR', "
        "'TORCHINDUCTOR_CACHE_DIR', 'XDG_CACHE_HOME'):\n"
        "        assert not Path(os.environ[var]).is_relative_to(Path.home())\n"
        "        assert Path(os.environ[var]).parts[-2] == 'cache'\n"
    )
    fx.make_patch(
        "fx/0002-fix-scale.patch",
        {"vllm/mod.py": FIXED_ADD.replace("return x * 2", "return x * 1")},
        "[Core] Fix scale",
        [REG_SCALE, "tests/patches/test_env.py"],
        base="HEAD~1",
    )
    p, r = run_main(fx)
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["fx/0002-fix-scale.patch"]["tests"] == "pass"
