"""apply.py's main job, on fixture repositories, run as a user runs it."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import (
    APPLY,
    FIXED_ADD,
    FIXED_BOTH,
    MOD_V1,
    MOD_V11,
    REG_ADD,
    REG_SCALE,
    Fixture,
    git,
    git_on_path,
    standard_stack,
)
from test_deliver import make_wheel, wheel_files
from test_installed import listing, make_venv, pip_install
from test_real_base import fake_index


def patch_rows(rep: dict, stack: str = "fx") -> dict[str, dict]:
    st = next(s for s in rep["stacks"] if s["name"] == stack)
    return {p["file"]: p for p in st["patches"]}


def test_clean_apply_report_and_branch(fx: Fixture) -> None:
    standard_stack(fx)
    before = fx.snapshot()
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = fx.report(out)
    rows = patch_rows(rep)
    for f in ("fx/0001-fix-add.patch", "fx/0002-fix-scale.patch"):
        assert rows[f]["apply"] == "clean"
        assert rows[f]["regression"] == {"base": "fail", "patched": "pass"}
        assert rows[f]["tests"] == "pass"
        assert rows[f]["seconds"] >= 0
    st = rep["stacks"][0]
    assert st["base_commit"] == git("rev-parse", "v1.0.0", cwd=fx.upstream)
    assert st["branch"] == "refs/heads/patched/fx/v1.0.0"
    head = git("rev-parse", "refs/heads/patched/fx/v1.0.0", cwd=fx.upstream)
    assert git("show", f"{head}:vllm/mod.py", cwd=fx.upstream) + "\n" == \
        FIXED_ADD.replace("return x * 2", "return x * 1")
    assert git("rev-list", "--count", f"v1.0.0..{head}", cwd=fx.upstream) == "2"
    # the table a person reads
    assert "fx/0001-fix-add.patch" in p.stdout and "clean" in p.stdout
    assert "refs/heads/patched/fx/v1.0.0" in p.stdout
    assert fx.snapshot() == before


def test_rerun_is_deterministic_and_reuses_worktree(fx: Fixture) -> None:
    standard_stack(fx)
    assert fx.run("--repo", str(fx.upstream), "--no-tests").returncode == 0
    first = git("rev-parse", "refs/heads/patched/fx/v1.0.0", cwd=fx.upstream)
    assert fx.run("--repo", str(fx.upstream), "--no-tests").returncode == 0
    assert git("rev-parse", "refs/heads/patched/fx/v1.0.0", cwd=fx.upstream) == first


def test_context_drift_uses_three_way(fx: Fixture) -> None:
    standard_stack(fx)
    # upstream changes a context line of 0001's hunk, away from the fixed line
    git("checkout", "-q", "--detach", "v1.0.0", cwd=fx.tmp / "work")
    work = fx.tmp / "work"
    (work / "vllm" / "mod.py").write_text(MOD_V1.replace("\n\n\ndef add",
                                                         "\n# helpers\n\ndef add"))
    git("commit", "-q", "-am", "drift", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/tags/v1.0.1", cwd=work)
    before = fx.snapshot()
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--base", "v1.0.1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = patch_rows(fx.report(out))
    assert rows["fx/0001-fix-add.patch"]["apply"] == "3way"
    assert rows["fx/0002-fix-scale.patch"]["apply"] == "clean"
    assert rows["fx/0001-fix-add.patch"]["regression"]["patched"] == "pass"
    assert fx.snapshot() == before


def test_true_conflict_exit_1_names_patch_and_files(fx: Fixture) -> None:
    standard_stack(fx)
    before = fx.snapshot()
    out = fx.tmp / "r.json"
    # v1.1.0 changed scale() to x * 3: 0002 conflicts, and its regression test
    # still fails there, so it is a real conflict
    p = fx.run("--repo", str(fx.upstream), "--base", "v1.1.0", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    rows = patch_rows(fx.report(out))
    assert rows["fx/0001-fix-add.patch"]["apply"] == "clean"
    bad = rows["fx/0002-fix-scale.patch"]
    assert bad["apply"] == "conflict"
    assert bad["conflict_files"] == ["vllm/mod.py"]
    assert bad["regression"]["base"] == "fail"
    assert "conflicts in vllm/mod.py" in p.stdout
    assert fx.snapshot() == before
    # the branch holds what did apply, nothing half-applied
    head = git("rev-parse", "refs/heads/patched/fx/v1.1.0", cwd=fx.upstream)
    assert git("rev-list", "--count", f"v1.1.0..{head}", cwd=fx.upstream) == "1"


def test_not_needed_when_upstream_fixed_it_differently(fx: Fixture) -> None:
    standard_stack(fx)
    work = fx.tmp / "work"
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "vllm" / "mod.py").write_text(MOD_V1.replace("return x * 2",
                                                         "return x  # fixed"))
    git("commit", "-q", "-am", "upstream fix", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/tags/v1.2.0", cwd=work)
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--base", "v1.2.0", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = patch_rows(fx.report(out))
    assert rows["fx/0002-fix-scale.patch"]["apply"] == "not-needed"
    assert rows["fx/0002-fix-scale.patch"]["regression"]["base"] == "pass"
    assert rows["fx/0001-fix-add.patch"]["apply"] == "clean"


def test_regression_passing_on_base_is_a_failure(fx: Fixture) -> None:
    standard_stack(fx)
    # a regression test that cannot fail proves nothing: exit 1
    (fx.project / "tests" / "patches" / "test_scale.py").write_text(
        "def test_scale_regression():\n    assert True\n")
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out))
    assert p.returncode == 1
    assert patch_rows(fx.report(out))["fx/0002-fix-scale.patch"]["regression"][
        "base"] == "pass"


def test_failing_targeted_test_exit_1(fx: Fixture) -> None:
    standard_stack(fx)
    (fx.project / "tests" / "patches" / "test_add.py").write_text(
        (fx.project / "tests" / "patches" / "test_add.py").read_text()
        + "\n\ndef test_broken():\n    assert False\n")
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out))
    assert p.returncode == 1
    row = patch_rows(fx.report(out))["fx/0001-fix-add.patch"]
    assert row["regression"]["patched"] == "pass"
    assert row["tests"] == "fail"


def test_repo_from_environment_and_local_dir(fx: Fixture) -> None:
    standard_stack(fx)
    p = fx.run("--no-tests", env={"VLLM_REPO": str(fx.upstream)})
    assert p.returncode == 0, p.stderr
    git("clone", "-q", str(fx.upstream), str(fx.tmp / "vllm"), cwd=fx.tmp)
    p = fx.run("--no-tests")  # cwd is fx.tmp, which holds ./vllm
    assert p.returncode == 0, p.stderr
    assert "patched/fx/v1.0.0" in p.stdout


def test_unavailable_base_is_skipped_not_passed(fx: Fixture) -> None:
    standard_stack(fx)
    fx.write_series(
        "#@ stack fx repo=https://example.invalid/vllm branch=pr-branch "
        "commit=" + "ab" * 20 + "\n"
        "fx/0001-fix-add.patch\nfx/0002-fix-scale.patch\n")
    out = fx.tmp / "r.json"
    p = fx.run("--json", str(out))  # no repository: the cache, offline
    assert p.returncode == 1  # nothing ran at all
    st = fx.report(out)["stacks"][0]
    assert st["status"] == "skipped"
    assert st["fetch"] == (f"git -C {fx.cache / 'vllm.git'} fetch "
                           "https://example.invalid/vllm " + "ab" * 20)
    assert all(r["apply"] == "skipped" for r in st["patches"])
    assert "not verified" in p.stdout and "WARNING" in p.stdout


def test_skip_counts_only_with_require_all(fx: Fixture) -> None:
    standard_stack(fx)
    body = fx.series.read_text()
    fx.write_series(body + "#@ stack pr repo=https://example.invalid/fork "
                    "branch=b commit=" + "cd" * 20 + "\n")
    fx.make_patch("pr/0001-x.patch", {"vllm/other.py": "X = 1\n"}, "[X] x",
                  [REG_ADD], base="v1.0.0")
    fx.write_series(fx.series.read_text() + "pr/0001-x.patch\n")
    p = fx.run("--repo", str(fx.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SKIPPED" in p.stdout
    p = fx.run("--repo", str(fx.upstream), "--require-all")
    assert p.returncode == 1


def test_killed_during_git_am_then_rerun_succeeds(fx: Fixture) -> None:
    standard_stack(fx)
    # SIGKILL apply.py (and the am) once git am has begun
    env = git_on_path(fx.tmp / "bin", '  "$REAL" "$@" & pid=$!\n'
                      "  sleep 0.05; kill -9 $PPID $pid; exit 137\n")
    before = fx.snapshot()
    p = fx.run("--repo", str(fx.upstream), env=env)
    assert p.returncode == -signal.SIGKILL
    assert fx.snapshot() == before
    out = fx.tmp / "r.json"
    p = fx.run("--repo", str(fx.upstream), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(r["apply"] == "clean" for r in patch_rows(fx.report(out)).values())
    assert fx.snapshot() == before


def test_series_hash_and_report_shape(fx: Fixture) -> None:
    standard_stack(fx)
    out = fx.tmp / "r.json"
    assert fx.run("--repo", str(fx.upstream), "--json", str(out)).returncode == 0
    rep = fx.report(out)
    assert rep["exit_code"] == 0
    st = rep["stacks"][0]
    for key in ("name", "base", "base_commit", "patches", "branch"):
        assert key in st
    row = st["patches"][0]
    assert set(row) >= {"file", "apply", "regression", "tests", "seconds"}


def test_help_for_every_command() -> None:
    for cmd in ([], ["check"], ["test"], ["base"], ["format-patch"]):
        p = subprocess.run([sys.executable, str(APPLY), *cmd, "--help"],
                           capture_output=True, text=True, check=False)
        assert p.returncode == 0
        assert "example" in p.stdout


def test_stale_lock_from_killed_run_is_not_fatal(fx: Fixture) -> None:
    standard_stack(fx)
    assert fx.run("--repo", str(fx.upstream), "--no-tests").returncode == 0
    # a killed run can leave git's index.lock in the tool's worktree
    wts = git("worktree", "list", "--porcelain", cwd=fx.upstream)
    paths = [ln.split(" ", 1)[1] for ln in wts.splitlines()
             if ln.startswith("worktree ") and "worktrees" in ln]
    assert paths
    admin = git("rev-parse", "--path-format=absolute", "--git-dir",
                cwd=Path(paths[0]))
    (Path(admin) / "index.lock").write_text("")
    t0 = time.monotonic()
    assert fx.run("--repo", str(fx.upstream), "--no-tests").returncode == 0
    assert time.monotonic() - t0 < 60


def one_line_error(p, *want: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("apply.py: error: "), p.stderr
    for w in want:
        assert w in lines[0], lines[0]


def test_unwritable_cache_is_an_environment_fault(fx: Fixture) -> None:
    """A cache the tool cannot write is one line and exit 2 for the main
    job and for `check`, never a verdict ("does not apply", "FAILED")."""
    standard_stack(fx)
    blocker = fx.tmp / "a-file"
    blocker.write_text("")
    env = {"VLLM_PATCHES_CACHE": str(blocker / "cache")}
    one_line_error(fx.run("--repo", str(fx.upstream), env=env), "not writable")
    one_line_error(fx.run("check", env=env), "not writable")


def test_unwritable_json_refused_before_the_run(fx: Fixture) -> None:
    standard_stack(fx)
    blocker = fx.tmp / "a-file"
    blocker.write_text("")
    for out in (blocker / "r.json", fx.tmp):  # under a file; a directory
        p = fx.run("--repo", str(fx.upstream), "--json", str(out))
        one_line_error(p, f"--json {out}: cannot write there")
        assert p.stdout == ""  # nothing ran


def test_base_short_of_a_release_is_bad_input(fx: Fixture) -> None:
    """`--base v1.0` (for v1.0.0) is a typo: exit 2 offline and online
    alike, unless the clone has such a ref."""
    standard_stack(fx)
    for env in ({"VLLM_PATCHES_OFFLINE": ""}, {}):  # online, offline
        one_line_error(fx.run("--base", "v1.0", env=env), "v1.0", "not a release")
    git("tag", "v1.0", "v1.0.0", cwd=fx.upstream)
    p = fx.run("--base", "v1.0", "--repo", str(fx.upstream), "--stack", "fx")
    assert p.returncode == 0, p.stdout + p.stderr


def two_stacks(fx: Fixture) -> None:
    """Stack `old` pinned to v1.0.0, stack `new` to v1.1.0 (each fixes add),
    and a commit after v1.1.0 on branch `after`."""
    fixed_v11 = MOD_V11.replace("return a - b  # bug: subtraction", "return a + b")
    fx.make_patch("old/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                  "[Core] Fix add", [REG_ADD], base="v1.0.0")
    fx.make_patch("new/0001-fix-add.patch", {"vllm/mod.py": fixed_v11},
                  "[Core] Fix add", [REG_ADD], base="v1.1.0")
    fx.write_series(
        "#@ stack old repo=https://example.invalid/vllm tag=v1.0.0\n"
        "old/0001-fix-add.patch\n"
        "#@ stack new repo=https://example.invalid/vllm tag=v1.1.0\n"
        "new/0001-fix-add.patch\n")
    work = fx.tmp / "after"
    git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    git("checkout", "-q", "--detach", "v1.1.0", cwd=work)
    (work / "extra.txt").write_text("after v1.1.0\n")
    git("add", "extra.txt", cwd=work)
    git("commit", "-q", "-m", "after v1.1.0", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/heads/after", cwd=work)


def test_base_commit_picks_the_stack_of_its_release(fx: Fixture) -> None:
    """A commit, an abbreviated one, a branch or HEAD of a clone (--repo,
    or the current directory) is said as release + commits, and takes the
    stack of that release, never the first stack by default."""
    two_stacks(fx)
    after = git("rev-parse", "after", cwd=fx.upstream).strip()
    v100 = git("rev-parse", "v1.0.0^{commit}", cwd=fx.upstream).strip()
    up = ["--repo", str(fx.upstream), "--no-tests"]
    for base, said, stack in ((after, "v1.1.0 + 1 commit", "new"),
                              (after[:9], "v1.1.0 + 1 commit", "new"),
                              ("after", "v1.1.0 + 1 commit", "new"),
                              (v100, "= v1.0.0", "old")):
        p = fx.run(*up, "--base", base)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"base {base} (" in p.stderr and said in p.stderr, p.stderr
        assert f"== stack {stack} on {base}" in p.stdout, p.stdout
    clone = fx.tmp / "clone"
    git("clone", "-q", "-b", "after", str(fx.upstream), str(clone), cwd=fx.tmp)
    p = fx.run("--base", "HEAD", "--no-tests", cwd=clone)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "v1.1.0 + 1 commit" in p.stderr and "== stack new on HEAD" in p.stdout
    assert git("status", "--porcelain", cwd=clone) == ""  # the clone untouched


def test_base_commit_after_a_release_candidate(fx: Fixture) -> None:
    """A commit after a release candidate's tag (v1.2.0rc1, on the way to
    the next release) stands on the release below it, not on the rc."""
    two_stacks(fx)
    work = fx.tmp / "rc"
    git("clone", "-q", "-b", "after", str(fx.upstream), str(work), cwd=fx.tmp)
    git("tag", "v1.2.0rc1", cwd=work)
    git("commit", "-q", "--allow-empty", "-m", "after the rc", cwd=work)
    p = fx.run("--base", "HEAD", "--no-tests", cwd=work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "v1.1.0 + 2 commits" in p.stderr and "== stack new on HEAD" in p.stdout


def test_base_between_pins_takes_the_stack_that_applies(fx: Fixture) -> None:
    """A release between two stacks' pins: each neighbour is applied there,
    the older pin's first; the first that applies whole runs, else the one
    where the most patches apply, and the patches needing a port are named.
    (Before, the older stack ran whatever applied.)"""
    two_stacks(fx)
    fx.make_patch("old/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                  "[Core] Fix add", [REG_ADD], base="v1.0.0")
    fx.make_patch("old/0002-fix-scale.patch", {"vllm/mod.py": FIXED_BOTH},
                  "[Core] Fix scale", [REG_SCALE])  # conflicts on v1.1.0
    fx.write_series(fx.series.read_text().replace(
        "old/0001-fix-add.patch\n",
        "old/0001-fix-add.patch\nold/0002-fix-scale.patch\n"))
    git("tag", "v1.0.5", "v1.0.0^{commit}", cwd=fx.upstream)
    git("tag", "v1.0.9", "v1.1.0^{commit}", cwd=fx.upstream)
    drift = MOD_V11.replace("return a - b  # bug: subtraction", "return a - b - 0")
    git("tag", "v1.0.7", commit_on(fx, "v1.1.0", {"vllm/mod.py": drift}),
        cwd=fx.upstream)
    up = ["--repo", str(fx.upstream), "--no-tests", "--base"]
    between = ("no stack is pinned to {}: it lies between 'old' (pinned to "
               "v1.0.0) and 'new' (pinned to v1.1.0)")
    p = fx.run(*up, "v1.0.5")
    assert p.returncode == 0, p.stdout + p.stderr
    assert between.format("v1.0.5") in p.stderr, p.stderr
    assert "'old': 2 of 2 patches apply" in p.stderr, p.stderr
    assert "'new':" not in p.stderr, p.stderr  # not tried
    assert "== stack old on v1.0.5" in p.stdout, p.stdout
    p = fx.run(*up, "v1.0.9")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "'old': 1 of 2 patches apply; old/0002 need a port" in p.stderr
    assert "'new': 1 of 1 patches apply" in p.stderr, p.stderr
    assert "using stack 'new', which applies whole" in p.stderr
    assert "== stack new on v1.0.9" in p.stdout, p.stdout
    p = fx.run(*up, "v1.0.7")
    assert p.returncode == 1, p.stdout + p.stderr  # the run shows the conflict
    assert "'new': 0 of 1 patches apply; new/0001 need a port" in p.stderr
    assert "no stack applies whole on v1.0.7: using 'old'" in p.stderr, p.stderr
    assert "== stack old on v1.0.7" in p.stdout, p.stdout
    p = fx.run(*up, "v1.1.0")
    assert p.returncode == 0 and "no stack is pinned" not in p.stderr


def commit_on(fx: Fixture, rev: str, files: dict[str, str]) -> str:
    """A commit of `files` on `rev` in the fixture's upstream, on no branch."""
    work = fx.tmp / "commit-on"
    if not work.exists():
        git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    git("fetch", "-q", "origin", "--tags", cwd=work)
    git("checkout", "-q", "--detach", rev, cwd=work)
    for rel, text in files.items():
        (work / rel).write_text(text)
    git("commit", "-q", "-am", f"on {rev}", cwd=work)
    head = git("rev-parse", "HEAD", cwd=work).strip()
    git("push", "-q", str(fx.upstream), f"{head}:refs/heads/on-{rev}", cwd=work)
    return head


def test_base_release_forms_and_before_every_pin(fx: Fixture) -> None:
    """A release as a version (1.1.0) is its tag's; a release older than
    every pin takes the oldest pinned stack and says so. (Before, 1.1.0
    took the first stack, and a clone did not know it.)"""
    two_stacks(fx)
    git("tag", "v0.9.0", "v1.0.0^{commit}", cwd=fx.upstream)
    up = ["--repo", str(fx.upstream), "--no-tests", "--base"]
    p = fx.run(*up, "1.1.0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "== stack new on v1.1.0 (" in p.stdout, p.stdout
    p = fx.run(*up, "v0.9.0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("using stack 'old' (pinned to v1.0.0): v0.9.0 is older than every "
            "stack's pin") in p.stderr, p.stderr


def test_base_that_cannot_be_had_downloads_nothing(fx: Fixture) -> None:
    """Online with a stand-in package index that has only the pin's
    release: a release it lacks is exit 2 naming the newest, and the pin's
    wheel is not downloaded for a base that cannot be had."""
    standard_stack(fx)
    fx.write_series(fx.series.read_text().replace(
        " repo=https://example.invalid/vllm", ""))  # pinned to a release
    idx = fake_index(fx.tmp / "idx", "1.0.0")
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(idx)}
    one_line_error(fx.run("--base", "v1.0.5", "--no-tests", env=env),
                   "vllm 1.0.5 is not a release", "the newest is 1.0.0")
    assert not list(fx.cache.glob("dist/*.whl")), list(fx.cache.glob("dist/*"))


def test_base_command_takes_the_global_base(fx: Fixture) -> None:
    """`apply.py --base REV base` resolves REV, not the stack's pin; two
    different bases are exit 2. (Before, the global --base was ignored.)"""
    standard_stack(fx)
    up = ["--repo", str(fx.upstream), "--stack", "fx"]
    p = fx.run("--base", "v1.1.0", "base", *up)
    assert p.returncode == 0 and p.stdout.startswith("v1.1.0 "), p.stdout + p.stderr
    one_line_error(fx.run("--base", "v1.1.0", "base", "v1.0.0", *up), "two bases")


def test_base_built_vllm_wheel_or_installed(fx: Fixture) -> None:
    """--base FILE.whl and --base installed: the built vLLM's Python sources
    are the base and its version picks the stack; the inspected environment
    is left as it was; a build between releases, a wheel that is not there:
    exit 2 and one line. (Before, both were unknown revisions.)"""
    two_stacks(fx)
    files = wheel_files(fx.upstream, "v1.1.0")
    whl = make_wheel(fx.tmp, "1.1.0", files, commit="4567def89")
    (fx.cache / "dist").mkdir(parents=True)  # the pin's release wheel, cached
    shutil.copy(whl, fx.cache / "dist")
    p = fx.run("--base", str(whl), "--no-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"base {whl.name} = vllm 1.1.0: a build of v1.1.0" in p.stderr
    assert f"== stack new on {whl.name} (" in p.stdout, p.stdout
    assert "from wheel, upstream 4567def89)" in p.stdout, p.stdout
    dev = whl.with_name(whl.name.replace("1.1.0", "1.1.1.dev3+g4567def89"))
    shutil.copy(whl, dev)
    one_line_error(fx.run("--base", str(dev), "--no-tests"),
                   "vllm 1.1.1.dev3+g4567def89 is a build between releases",
                   "--stack")
    p = fx.run("--base", str(dev), "--stack", "new", "--no-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    one_line_error(fx.run("--base", "gone.whl"), "--base gone.whl: not a file")
    python, site = make_venv(fx.tmp)
    pip_install(python, whl)
    before = listing(site.parents[2])
    p = fx.run("--base", "installed", "--python", python, "--no-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "base installed-1.1.0 = vllm 1.1.0: a build of v1.1.0" in p.stderr
    assert "== stack new on installed-1.1.0 (" in p.stdout, p.stdout
    assert "from installed, upstream 4567def89)" in p.stdout, p.stdout
    assert listing(site.parents[2]) == before


def test_base_commit_offline_without_a_clone(fx: Fixture) -> None:
    """Offline, without a clone: a release's upstream commit that the cache
    holds is that release; any other commit is exit 2 and one line."""
    two_stacks(fx)
    p = fx.run("--base", "0123abc4567", "--no-tests")
    one_line_error(p, "--base 0123abc4567: no release below it", "--repo")
    # the cache's v1.1.0, made from a release built from upstream 4567def89
    cache = fx.cache / "vllm.git"
    git("fetch", "-q", "--no-tags", str(fx.upstream), "+refs/tags/v1.1.0:refs/src",
        cwd=cache)
    tree = git("rev-parse", "refs/src^{tree}", cwd=cache).strip()
    c = git("commit-tree", tree, "-m", "Release: v1.1.0",
            "-m", "Upstream-Commit: 4567def89", cwd=cache)
    git("tag", "v1.1.0", c, cwd=cache)
    p = fx.run("--base", "4567def890123", "--no-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "base 4567def890123 = v1.1.0" in p.stderr, p.stderr
    assert "== stack new on v1.1.0" in p.stdout, p.stdout
