"""The exit-code table of docs/commands.md, case by case: each row's
command, run in the row's situation on the fixture repositories, exits
with the row's code; exit 2 with one line on stderr and nothing run."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest
from conftest import FIXED_ADD, REG_ADD, ROOT, Fixture, git_on_path, standard_stack
from test_inputs import one_line_error
from test_mutants import add_mutant, mutants

Run = Callable[[Fixture], subprocess.CompletedProcess]
CASES: dict[str, Run] = {}
ROW = re.compile(r"^\| (\d) \| `([a-z-]+)` \| .+ \|$", re.MULTILINE)


def table() -> dict[str, int]:
    """docs/commands.md's table: case -> exit code."""
    text = (ROOT / "docs" / "commands.md").read_text()
    return {m[2]: int(m[1]) for m in ROW.finditer(text)}


def case(name: str) -> Callable[[Run], Run]:
    def register(run: Run) -> Run:
        CASES[name] = run
        return run

    return register


def main_job(
    fx: Fixture, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    standard_stack(fx)
    return fx.run("--repo", str(fx.upstream), *args, env=env)


def failing_test(fx: Fixture, test: str, body: str) -> None:
    path = fx.project / "tests" / "patches" / test
    path.write_text(path.read_text() + body)


def with_unreachable_stack(fx: Fixture) -> None:
    """A second stack pinned to a commit nothing at hand has."""
    standard_stack(fx)
    fx.write_series(
        fx.series.read_text() + "#@ stack pr repo=https://example."
        "invalid/fork branch=b commit=" + "cd" * 20 + "\n"
    )
    fx.make_patch(
        "pr/0001-x.patch",
        {"vllm/other.py": "X = 1\n"},
        "[X] x",
        [REG_ADD],
        base="v1.0.0",
    )
    fx.write_series(fx.series.read_text() + "pr/0001-x.patch\n")


case("all-good")(lambda fx: main_job(fx))
case("conflict")(lambda fx: main_job(fx, "--base", "v1.1.0"))
case("unknown-revision")(lambda fx: main_job(fx, "--base", "v9.9.9-nope"))
case("base-short-of-a-release")(lambda fx: main_job(fx, "--base", "v1.0"))
case("unwritable-json")(lambda fx: main_job(fx, "--json", str(fx.tmp)))


@case("test-failed")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    failing_test(fx, "test_add.py", "\n\ndef test_broken():\n    assert False\n")
    return main_job(fx)


@case("regression-passes-on-base")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_scale.py").write_text(
        "def test_scale_regression():\n    assert True\n"
    )
    return fx.run("--repo", str(fx.upstream))


@case("stack-not-verified")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    with_unreachable_stack(fx)
    return fx.run("--repo", str(fx.upstream))


@case("stack-not-verified-required")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    with_unreachable_stack(fx)
    return fx.run("--repo", str(fx.upstream), "--require-all")


@case("no-stack-ran")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    return fx.run()  # no repository: the empty cache, offline


@case("unwritable-cache")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    (fx.tmp / "a-file").write_text("")
    env = {"VLLM_PATCHES_CACHE": str(fx.tmp / "a-file" / "cache")}
    return fx.run("--repo", str(fx.upstream), env=env)


@case("cache-short-of-room")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    return main_job(fx, env={"VLLM_PATCHES_MIN_FREE_MB": str(2**40)})


@case("disk-full")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    full = '  echo "fatal: write error: No space left on device" >&2; exit 128\n'
    return main_job(fx, env=git_on_path(fx.tmp / "bin", full))


@case("export-not-standalone")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    f = fx.patches["fx/0001-fix-add.patch"]
    f.write_text(f.read_text().replace("Why it is needed.", "As the series says."))
    return fx.run("export", "0001", "--repo", str(fx.upstream))


@case("export-not-proven-here")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    kept = fx.project / "tests/upstream/fx/0001-fix-add/tests/test_add_gpu.py"
    kept.parent.mkdir(parents=True)
    kept.write_text(
        "import pytest\n\n\n"
        '@pytest.mark.skip(reason="needs a GPU")\n'
        "def test_add():\n    pass\n"
    )
    return fx.run("export", "0001", "--repo", str(fx.upstream), "--run-tests")


@case("export-no-identity")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    (fx.tmp / "gitconfig-empty").write_text("")
    env = {"GIT_CONFIG_GLOBAL": str(fx.tmp / "gitconfig-empty")}
    return fx.run("export", "0001", "--repo", str(fx.upstream), env=env)


@case("check-ok")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    return fx.run("check")


@case("check-problem")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    fx.make_patch(
        "fx/0003-x.patch",
        {"vllm/other.py": "X = 1\n"},
        "[X] x",
        [REG_ADD],
        status="Maybe",
    )
    fx.write_series(fx.series.read_text() + "fx/0003-x.patch\n")
    return fx.run("check")


@case("mutant-survives")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    add_mutant(
        fx,
        "0001-fix-add",
        "same-sum",
        FIXED_ADD,
        FIXED_ADD.replace("return a + b", "return b + a"),
    )
    return mutants(fx, "fx")[0]


@case("base-unavailable")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    return fx.run("base", "--stack", "fx")


@case("newer-releases")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx)
    return fx.run("status", "--newer", "--offline", "--repo", str(fx.upstream))


@case("up-to-date")
def _(fx: Fixture) -> subprocess.CompletedProcess:
    standard_stack(fx, tag="v1.1.0")
    return fx.run("status", "--newer", "--offline", "--repo", str(fx.upstream))


def test_every_row_is_a_case() -> None:
    assert sorted(table()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_exit_code(fx: Fixture, name: str) -> None:
    p = CASES[name](fx)
    want = table()[name]
    assert p.returncode == want, f"{name}: exit {p.returncode}, not {want}\n" + (
        p.stdout + p.stderr
    )
    if want == 2:
        one_line_error(p)
