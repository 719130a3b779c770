"""apply.py rebase / status / --time-machine on fixture repositories.

Upstream tags made here, on top of the fixture's v1.0.0 (add and scale buggy):
  v1.0.5  a line added at the top: both patches apply, at new line numbers
  v1.0.1  a context line of 0001's hunk changed: 0001 needs the 3-way merge
  v1.1.0  (fixture) scale() now x * 3: 0002 conflicts, its bug is still there
  v1.2.0  scale() fixed upstream another way: 0002 does not apply, not needed
  v1.3.0  scale() removed: 0002 does not apply, its bug is gone with the code
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import MOD_V1, Fixture, git, git_on_path, standard_stack

from applylib.core import STACK_KEYS
from applylib.seriesedit import stack_directive

NO_X2_TEST = '''\
from pathlib import Path


def test_scale_regression():
    import vllm.mod as m
    assert "return x * 2" not in Path(m.__file__).read_text()
'''


def tag(fx: Fixture, name: str, text: str) -> str:
    work = fx.tmp / "work"
    git("checkout", "-q", "--detach", "v1.0.0", cwd=work)
    (work / "vllm" / "mod.py").write_text(text)
    git("commit", "-q", "-am", name, cwd=work)
    git("push", "-q", str(fx.upstream), f"HEAD:refs/tags/{name}", cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


@pytest.fixture
def rb(fx: Fixture) -> Fixture:
    standard_stack(fx)
    tag(fx, "v1.0.5", "# header\n" + MOD_V1)
    tag(fx, "v1.0.1", MOD_V1.replace("\n\n\ndef add", "\n# helpers\n\ndef add"))
    tag(fx, "v1.2.0", MOD_V1.replace("return x * 2", "return x  # fixed"))
    tag(fx, "v1.3.0", MOD_V1.split("\n\ndef scale")[0] + "\n")
    return fx


def files(fx: Fixture) -> dict[str, bytes]:
    out = {"series": fx.series.read_bytes()}
    for p in sorted((fx.project / "patches").rglob("*.patch")):
        out[str(p.relative_to(fx.project))] = p.read_bytes()
    return out


def body(patch: bytes) -> bytes:
    """The message part of a patch file (everything before the diffstat)."""
    return patch.split(b"\n---\n", 1)[0]


def test_clean_rebase_refreshes_patches_and_pin(rb: Fixture) -> None:
    before, user = files(rb), rb.snapshot()
    p = rb.run("rebase", "--onto", "v1.0.5", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    after = files(rb)
    for f in ("patches/fx/0001-fix-add.patch", "patches/fx/0002-fix-scale.patch"):
        assert after[f] != before[f]  # new hunk line numbers and index lines
        assert body(after[f]) == body(before[f])  # same message and trailers
    new = git("rev-parse", "v1.0.5", cwd=rb.upstream)
    assert f"#@ stack fx repo=https://example.invalid/vllm tag=v1.0.5 commit={new}" \
        in after["series"].decode()
    assert "range-diff" in p.stdout and "clean" in p.stdout
    # the refreshed series is consistent: lint round-trip and the main job
    c = rb.run("check", "--repo", str(rb.upstream))
    assert c.returncode == 0 and "byte-identical" in c.stdout, c.stdout + c.stderr
    out = rb.tmp / "r.json"
    m = rb.run("--repo", str(rb.upstream), "--json", str(out))
    assert m.returncode == 0, m.stdout
    assert {r["apply"] for r in json.loads(out.read_text())["stacks"][0][
        "patches"]} == {"clean"}
    assert rb.snapshot() == user


def test_three_way_rebase_refreshes_so_it_applies_cleanly(rb: Fixture) -> None:
    p = rb.run("rebase", "--onto", "v1.0.1", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"fx/0001-fix-add.patch\s+3way", p.stdout)
    out = rb.tmp / "r.json"
    m = rb.run("--repo", str(rb.upstream), "--json", str(out))
    rows = json.loads(out.read_text())["stacks"][0]["patches"]
    assert m.returncode == 0 and [r["apply"] for r in rows] == ["clean", "clean"]


def test_not_needed_fixed_upstream_differently(rb: Fixture) -> None:
    before = files(rb)
    p = rb.run("rebase", "--onto", "v1.2.0", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    series = rb.series.read_text()
    active = [ln for ln in series.splitlines() if ln and not ln.startswith("#")]
    assert active == ["fx/0001-fix-add.patch"]
    assert re.search(r"^#@ not-needed fx/0002-fix-scale.patch base=v1.2.0 "
                     r"reason='does not apply; its regression tests pass", series,
                     re.M)
    # the file stays for history, unchanged; the tree stays consistent
    assert files(rb)["patches/fx/0002-fix-scale.patch"] == \
        before["patches/fx/0002-fix-scale.patch"]
    # the header still says Pending: check warns (and passes)
    c = rb.run("check", "--repo", str(rb.upstream))
    assert c.returncode == 0, c.stdout + c.stderr
    assert ("warning: patches/fx/0002-fix-scale.patch is not needed on v1.2.0 "
            "(stack fx) but says 'Upstream-Status: Pending'") in c.stdout
    assert rb.run("--repo", str(rb.upstream)).returncode == 0
    # once the header names the upstream fix, the warning goes
    f = rb.project / "patches" / "fx" / "0002-fix-scale.patch"
    f.write_text(f.read_text().replace(
        "Upstream-Status: Pending", "Upstream-Status: Backport [v1.2.0]"))
    c = rb.run("check", "--repo", str(rb.upstream))
    assert c.returncode == 0 and "warning" not in c.stdout, c.stdout + c.stderr


def test_not_needed_code_removed(rb: Fixture) -> None:
    (rb.project / "tests" / "patches" / "test_scale.py").write_text(NO_X2_TEST)
    p = rb.run("rebase", "--onto", "v1.3.0", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "#@ not-needed fx/0002-fix-scale.patch base=v1.3.0" in \
        rb.series.read_text()


def start_conflict(rb: Fixture) -> subprocess.CompletedProcess[str]:
    p = rb.run("rebase", "--onto", "v1.1.0", "--repo", str(rb.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "CONFLICT: fx/0002-fix-scale.patch" in p.stdout
    assert "vllm/mod.py" in p.stdout
    for cmd in ("--continue", "--skip", "--abort"):
        assert f"apply.py rebase --series {rb.series} {cmd}" in p.stdout
    return p


def conflict_worktree(p: subprocess.CompletedProcess[str]) -> Path:
    return Path(re.search(r"conflicting files \(in (\S+)\)", p.stdout).group(1))


def test_conflict_then_abort_restores_everything(rb: Fixture) -> None:
    before, user = files(rb), rb.snapshot()
    p = start_conflict(rb)
    assert "<<<<<<<" in (conflict_worktree(p) / "vllm" / "mod.py").read_text()
    assert files(rb) == before  # nothing changes while stopped
    again = rb.run("rebase", "--onto", "v1.0.5", "--repo", str(rb.upstream))
    assert again.returncode == 2 and "in progress" in again.stderr
    a = rb.run("rebase", "--abort")
    assert a.returncode == 0, a.stderr
    assert files(rb) == before and rb.snapshot() == user
    assert rb.run("rebase", "--continue").returncode == 2  # nothing in progress


def test_conflict_then_continue(rb: Fixture) -> None:
    user = rb.snapshot()
    p = start_conflict(rb)
    wt = conflict_worktree(p)
    text = (wt / "vllm" / "mod.py").read_text()
    resolved = re.sub(r"<<<<<<<.*?>>>>>>>[^\n]*\n", "    return x * 1\n", text,
                      flags=re.S)
    # continuing before resolving is refused, and changes nothing
    nope = rb.run("rebase", "--continue")
    assert nope.returncode == 2 and "unresolved" in nope.stderr
    # a resolution that keeps the bug is committed but not kept: --continue
    # stops again until the commit passes the patch's regression tests
    (wt / "vllm" / "mod.py").write_text(resolved.replace("x * 1", "x * 4"))
    git("add", "vllm/mod.py", cwd=wt)
    bad = rb.run("rebase", "--continue")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "does not pass its regression tests (fail" in bad.stdout
    (wt / "vllm" / "mod.py").write_text(resolved)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--amend",
        "--no-edit", "-a", cwd=wt)
    c = rb.run("rebase", "--continue")
    assert c.returncode == 0, c.stdout + c.stderr
    assert re.search(r"fx/0002-fix-scale.patch\s+resolved", c.stdout)
    new = (rb.project / "patches" / "fx" / "0002-fix-scale.patch").read_text()
    assert "-    return x * 3\n+    return x * 1" in new
    assert "tag=v1.1.0" in rb.series.read_text()
    out = rb.tmp / "r.json"
    m = rb.run("--repo", str(rb.upstream), "--json", str(out))
    assert m.returncode == 0, m.stdout + m.stderr
    assert rb.snapshot() == user


def test_conflict_then_skip_drops_the_patch(rb: Fixture) -> None:
    start_conflict(rb)
    s = rb.run("rebase", "--skip")
    assert s.returncode == 0, s.stdout + s.stderr
    series = rb.series.read_text()
    assert "#@ dropped fx/0002-fix-scale.patch base=v1.1.0" in series
    assert [ln for ln in series.splitlines() if ln and not ln.startswith("#")] \
        == ["fx/0001-fix-add.patch"]
    assert rb.run("check", "--repo", str(rb.upstream)).returncode == 0


def test_crash_in_the_middle_then_rerun(rb: Fixture) -> None:
    before, user = files(rb), rb.snapshot()
    # SIGKILL apply.py at its second git am (the first patch is already in)
    count = rb.tmp / "bin" / "count"
    env = git_on_path(rb.tmp / "bin",
                      f'  n=$(cat "{count}" 2>/dev/null || echo 0); n=$((n+1))\n'
                      f'  echo $n > "{count}"\n'
                      "  if [ $n -ge 3 ]; then kill -9 $PPID; exit 137; fi\n")
    p = rb.run("rebase", "--onto", "v1.0.5", "--repo", str(rb.upstream), env=env)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert files(rb) == before and rb.snapshot() == user
    again = rb.run("rebase", "--onto", "v1.0.5", "--repo", str(rb.upstream))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "crashed rebase" in again.stderr
    assert "tag=v1.0.5" in rb.series.read_text()
    assert rb.snapshot() == user


def test_status_matrix(rb: Fixture) -> None:
    out = rb.tmp / "m.json"
    user = rb.snapshot()
    p = rb.run("status", "--bases", "v1.0.0,v1.0.1,v1.1.0,v1.2.0,v1.3.0",
               "--repo", str(rb.upstream), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    cols = {c["base"]: {f: {k: v for k, v in cell.items()
                            if k in ("apply", "regression_base")}
                        for f, cell in c["cells"].items()}
            for c in json.loads(out.read_text())["columns"]}
    raw = {c["base"]: c["cells"] for c in json.loads(out.read_text())["columns"]}
    a, s = "fx/0001-fix-add.patch", "fx/0002-fix-scale.patch"
    assert cols["v1.0.0"][a] == {"apply": "clean", "regression_base": "fail"}
    assert cols["v1.0.1"][a]["apply"] == "3way"
    assert cols["v1.1.0"][s] == {"apply": "conflict", "regression_base": "fail"}
    assert cols["v1.2.0"][s] == {"apply": "not-needed", "regression_base": "pass"}
    # removed code: the fixture's regression test errors (no scale()): it
    # cannot tell, so the cell stays a conflict and the reason is shown
    assert cols["v1.3.0"][s]["apply"] == "conflict"
    assert cols["v1.3.0"][s]["regression_base"] == "error"
    assert "AttributeError" in raw["v1.3.0"][s]["reason"]
    assert "conflict/error" in p.stdout and "cannot tell:" in p.stdout
    assert "not-needed" in p.stdout and "3way" in p.stdout
    assert rb.snapshot() == user


def test_time_machine_finds_newest_base_where_all_apply(rb: Fixture) -> None:
    before = files(rb)
    p = rb.run("rebase", "--time-machine", "v1.0.0..v1.3.0", "--dry-run",
               "--repo", str(rb.upstream), "--offline")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "newest base where the stack applies: v1.0.5" in p.stdout
    assert "v1.3.0: 1 do not apply" in p.stdout
    assert files(rb) == before  # a dry run changes nothing
    p = rb.run("rebase", "--time-machine", "v1.0.0..v1.3.0",
               "--repo", str(rb.upstream), "--offline")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tag=v1.0.5" in rb.series.read_text()


def test_rebase_bad_inputs(rb: Fixture) -> None:
    p = rb.run("rebase", "--repo", str(rb.upstream))
    assert p.returncode == 2 and "--onto" in p.stderr
    p = rb.run("rebase", "--onto", "v7.7.7-nope", "--repo", str(rb.upstream))
    assert p.returncode == 2 and "unknown revision" in p.stderr
    p = rb.run("status", "--repo", str(rb.upstream))
    assert p.returncode == 2 and "--bases" in p.stderr


def test_error_stops_the_rebase_never_not_needed(rb: Fixture) -> None:
    """On v1.3.0 scale() is gone: 0002 does not apply, and its regression
    test (which calls scale) errors there instead of failing with its
    signature. That says nothing about the bug: the rebase stops."""
    before = files(rb)
    p = rb.run("rebase", "--onto", "v1.3.0", "--repo", str(rb.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cannot tell whether it is still needed" in p.stdout
    assert "AttributeError" in p.stdout
    assert "not-needed" not in rb.series.read_text()
    assert files(rb) == before
    assert rb.run("rebase", "--abort").returncode == 0
    assert files(rb) == before


def test_already_applied_upstream_is_recorded_not_exported(rb: Fixture) -> None:
    """A base holding 0002 word for word: git am makes no commit for it;
    the rebase must not export the previous commit into 0002's file."""
    tag(rb, "v1.2.1", MOD_V1.replace("return x * 2", "return x * 1"))
    before = files(rb)
    p = rb.run("rebase", "--onto", "v1.2.1", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    series = rb.series.read_text()
    assert re.search(r"^#@ not-needed fx/0002-fix-scale.patch base=v1.2.1 "
                     r"reason='the base already holds it word for word", series,
                     re.M)
    after = files(rb)
    assert after["patches/fx/0002-fix-scale.patch"] == \
        before["patches/fx/0002-fix-scale.patch"]
    assert body(after["patches/fx/0001-fix-add.patch"]) == \
        body(before["patches/fx/0001-fix-add.patch"])


def test_rebase_into_a_new_stack(rb: Fixture) -> None:
    """--as NAME carries the stack to the new base as a stack of its own
    (patches/NAME/), for the users of the old base the old one stays."""
    before = files(rb)
    p = rb.run("rebase", "--onto", "v1.2.0", "--as", "fx-next",
               "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "as new stack 'fx-next'" in p.stdout
    after = files(rb)
    for f in ("patches/fx/0001-fix-add.patch", "patches/fx/0002-fix-scale.patch"):
        assert after[f] == before[f]
    new = after["patches/fx-next/0001-fix-add.patch"]
    assert body(new) == body(before["patches/fx/0001-fix-add.patch"])
    assert "patches/fx-next/0002-fix-scale.patch" not in after
    series = rb.series.read_text()
    assert "#@ stack fx repo=https://example.invalid/vllm tag=v1.0.0" in series
    assert re.search(r"^#@ stack fx-next repo=\S+ tag=v1.2.0 commit=[0-9a-f]{40}$",
                     series, re.M)
    assert re.search(r"^#@ not-needed fx/0002-fix-scale.patch base=v1.2.0 ",
                     series, re.M)
    assert rb.run("check", "--repo", str(rb.upstream)).returncode == 0
    for stack in ("fx", "fx-next"):
        m = rb.run("--repo", str(rb.upstream), "--stack", stack)
        assert m.returncode == 0, m.stdout + m.stderr
    again = rb.run("rebase", "--onto", "v1.2.0", "--as", "fx-next",
                   "--repo", str(rb.upstream))
    assert again.returncode == 2 and "already has a stack" in again.stderr


def test_newer_releases_and_what_the_stack_needs_there(rb: Fixture) -> None:
    """status --newer: the releases past the newest stack's pin, the matrix
    on them and the step for each patch on the newest; up to date: exit 0."""
    p = rb.run("status", "--newer", "--offline", "--repo", str(rb.upstream))
    assert p.returncode == 1, p.stdout + p.stderr
    assert ("newer than v1.0.0 (stack fx; cached tags only (index not "
            "reached)): v1.0.1, v1.0.5, v1.1.0, v1.2.0, v1.3.0") in p.stdout
    assert re.search(r"on v1\.3\.0:\n  fx/0001: applies \((clean|3way)\) and the "
                     r"bug is there: carry it\n  fx/0002: ", p.stdout), p.stdout
    assert ("next: python apply.py rebase --onto v1.3.0 --stack fx --as fx-v1.3"
            in p.stdout)
    rb.series.write_text(rb.series.read_text().replace("tag=v1.0.0",
                                                       "tag=v1.3.0"))
    p = rb.run("status", "--newer", "--offline", "--repo", str(rb.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("up to date: no vLLM release newer than v1.3.0")


def test_stack_directive_writes_every_pin_the_parser_reads():
    """A re-pinned stack line keeps every key the parser takes (the writer's
    key list once still named the removed `pypi` and not `assemble`)."""
    pins = {k: f"v-{k}" for k in sorted(STACK_KEYS)}
    line = stack_directive("s", pins)
    assert line.startswith("#@ stack s ")
    assert sorted(w.split("=")[0] for w in line.split()[3:]) == sorted(STACK_KEYS)
