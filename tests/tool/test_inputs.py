"""Bad input: exit 2 and one line on stderr naming the problem; check; export."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import APPLY, FIXED_ADD, REG_ADD, Fixture, git, standard_stack


def one_line_error(p: subprocess.CompletedProcess[str], *words: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("apply.py: error: ")
    for w in words:
        assert w in lines[0], lines[0]


def test_path_is_not_a_git_repository(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.tmp / "plain").mkdir()
    one_line_error(fx.run("--repo", str(fx.tmp / "plain")), "not a git repository")
    one_line_error(fx.run("--repo", str(fx.tmp / "nope")), "no such directory")


def test_unknown_revision(fx: Fixture) -> None:
    standard_stack(fx)
    before = fx.snapshot()
    one_line_error(fx.run("--repo", str(fx.upstream), "--base", "v9.9.9-nope"),
                   "unknown revision", "v9.9.9-nope")
    assert fx.snapshot() == before


def test_series_entry_whose_file_is_missing(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series(fx.series.read_text() + "fx/0003-missing.patch\n")
    one_line_error(fx.run("--repo", str(fx.upstream)), "fx/0003-missing.patch",
                   "does not exist")
    one_line_error(fx.run("check"), "does not exist")


def test_patch_file_not_in_series(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.project / "patches" / "fx" / "0009-stray.patch").write_bytes(
        fx.patches["fx/0001-fix-add.patch"].read_bytes())
    one_line_error(fx.run("--repo", str(fx.upstream)), "0009-stray.patch",
                   "not in the series")
    one_line_error(fx.run("check"), "not in the series")


@pytest.mark.parametrize("line,words", [
    ("#@ stack\n", ["malformed directive"]),
    ("#@ stack fx2 tag=v1 colour=blue\n", ["unknown key", "colour"]),
    ("#@ stack fx3 repo=x\n", ["pins no base"]),
    ("#@ stack fx4 commit=abc\n", ["40 hex"]),
    ("#@ frobnicate\n", ["unknown directive"]),
    ('#@ stack fx5 tag="v1\n', ["malformed directive"]),
    ("#@ stack fx6 tag=v1 notkeyvalue\n", ["key=value"]),
    ("#@ stack fx7 commit=" + "ab" * 20 + " assemble=main\n",
     ["assemble= must name a release", "main"]),
    ("#@ stack fx8 tag=v1 assemble=v1.0.0\n", ["assemble= needs", "commit="]),
    ("#@ stack fx9 tag=v1 pypi=vllm\n", ["unknown key", "pypi"]),
    ("#@ not-needed fx/0001-fix-add.patch reason=x\n", ["needs base="]),
    ("#@ dropped fx/0001-fix-add.patch base=v1 colour=blue\n",
     ["malformed directive"]),
    ("#@ pin fx/0001-fix-add.patch tag=v1 commit=" + "ab" * 20 + "\n",
     ["malformed directive"]),
])
def test_malformed_directive(fx: Fixture, line: str, words: list[str]) -> None:
    standard_stack(fx)
    fx.write_series(fx.series.read_text() + line)
    one_line_error(fx.run("--repo", str(fx.upstream)), *words)


def test_patch_before_any_stack(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series("fx/0001-fix-add.patch\n" + fx.series.read_text())
    one_line_error(fx.run("--repo", str(fx.upstream)), "before any")


def test_duplicate_entry(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series(fx.series.read_text() + "fx/0001-fix-add.patch\n")
    one_line_error(fx.run("--repo", str(fx.upstream)), "listed twice")


@pytest.mark.parametrize("bad", ["../evil.py", ".git/hooks/post-checkout",
                                 "vllm/../../x.py"])
def test_patch_touching_unsafe_path(fx: Fixture, bad: str) -> None:
    standard_stack(fx)
    p = fx.patches["fx/0001-fix-add.patch"]
    text = p.read_text().replace("a/vllm/mod.py", f"a/{bad}").replace(
        "b/vllm/mod.py", f"b/{bad}")
    p.write_text(text)
    before = fx.snapshot()
    one_line_error(fx.run("--repo", str(fx.upstream)), "not a safe relative path")
    one_line_error(fx.run("check"), "not a safe relative path")
    assert fx.snapshot() == before


def test_unsafe_series_entry(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series(fx.series.read_text() + "../outside.patch\n")
    one_line_error(fx.run("--repo", str(fx.upstream)), "not a safe relative path")


def test_empty_series(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series("# nothing here\n")
    one_line_error(fx.run("--repo", str(fx.upstream)), "lists no patch")
    fx.write_series("#@ stack fx tag=v1.0.0\n")
    (fx.project / "patches" / "fx" / "0001-fix-add.patch").unlink()
    (fx.project / "patches" / "fx" / "0002-fix-scale.patch").unlink()
    one_line_error(fx.run("--repo", str(fx.upstream)), "lists no patch")


def test_missing_series_file(fx: Fixture) -> None:
    one_line_error(fx.run("--repo", str(fx.upstream)), "series file not found")


def test_not_a_patch(fx: Fixture) -> None:
    standard_stack(fx)
    fx.patches["fx/0001-fix-add.patch"].write_text("hello\n")
    one_line_error(fx.run("--repo", str(fx.upstream)), "not a git format-patch")


def test_unknown_stack(fx: Fixture) -> None:
    standard_stack(fx)
    one_line_error(fx.run("--repo", str(fx.upstream), "--stack", "zz"),
                   "unknown stack 'zz'")


def test_test_command_bad_tree(fx: Fixture) -> None:
    standard_stack(fx)
    one_line_error(fx.run("test", "--tree", str(fx.tmp)), "not a vLLM tree")


# ---------------------------------------------------------------- check


def test_check_ok_and_round_trip(fx: Fixture) -> None:
    standard_stack(fx)
    p = fx.run("check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 patches in 1 stacks: ok" in p.stdout
    assert "round-trip not checked" in p.stdout  # no base at hand: said so
    p = fx.run("check", "--repo", str(fx.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "byte-identical" in p.stdout


def test_check_finds_non_deterministic_export(fx: Fixture) -> None:
    standard_stack(fx)
    work = fx.tmp / "work"
    out = fx.patches["fx/0001-fix-add.patch"]
    # the same commit exported with git's defaults (real commit id, numbered,
    # abbreviated index, signature)
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "vllm" / "mod.py").write_text(FIXED_ADD)
    git("commit", "-q", "-am", "[Core] Fix add\n\nWhy.\n\nBug: https://x/1\n"
        "Upstream-Status: Pending\nTests: " + REG_ADD + "\n"
        "Signed-off-by: a <b@c>", cwd=work)
    out.write_text(git("format-patch", "-1", "--stdout", "HEAD", cwd=work) + "\n")
    p = fx.run("check", "--repo", str(fx.upstream))
    assert p.returncode == 1
    assert "re-export differs" in p.stdout
    assert "--zero-commit" in p.stdout
    assert "abbreviated" in p.stdout


def test_check_trailers(fx: Fixture) -> None:
    fx.make_patch("fx/0001-x.patch", {"vllm/mod.py": FIXED_ADD}, "No prefix",
                  ["tests/patches/test_nope.py::t"], base="v1.0.0",
                  status="Merged")
    fx.write_series("#@ stack fx tag=v1.0.0\nfx/0001-x.patch\n")
    p = fx.run("check")
    assert p.returncode == 1
    assert "component prefix" in p.stdout
    assert "invalid 'Upstream-Status: Merged'" in p.stdout
    assert "test_nope.py' does not exist" in p.stdout


def test_check_spdx_on_new_python_file(fx: Fixture) -> None:
    fx.make_patch("fx/0001-new.patch", {"vllm/newmod.py": "X = 1\n"},
                  "[Core] Add a module", [REG_ADD], base="v1.0.0")
    fx.write_series("#@ stack fx tag=v1.0.0\nfx/0001-new.patch\n")
    p = fx.run("check")
    assert p.returncode == 1
    assert "SPDX" in p.stdout


def test_format_patch_is_deterministic(fx: Fixture) -> None:
    standard_stack(fx)
    work = fx.tmp / "work"
    a = subprocess.run([sys.executable, str(APPLY), "format-patch", "--repo",
                        str(work), "HEAD~1"], capture_output=True).stdout
    # user configuration that changes git's defaults must not leak in
    git("config", "format.signature", "custom", cwd=work)
    git("config", "diff.noprefix", "true", cwd=work)
    git("config", "core.abbrev", "7", cwd=work)
    b = subprocess.run([sys.executable, str(APPLY), "format-patch", "--repo",
                        str(work), "HEAD~1"], capture_output=True).stdout
    assert a == b == fx.patches["fx/0001-fix-add.patch"].read_bytes()
    assert a.startswith(b"From 0000000000000000000000000000000000000000 ")
