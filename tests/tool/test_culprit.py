"""apply.py status --culprit on a fixture repository with known culprits.

Upstream here is a linear history of 16 commits, c0 .. c15 (tagged v2.0.0 ..
v2.0.15), every one changing vllm/counter.py, and besides:
  c5   rewords the line fx/0001 fixes: from here 0001 does not apply (the
       bug is still there)
  c9   breaks `import vllm` (the regression tests error there: cannot tell)
  c10  repairs it
  c11  fixes add() upstream: from here 0001's bug is absent (absorbed)
fx/0002 (scale) applies everywhere and its bug is never fixed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import MOD_V1, Fixture, git, standard_stack

N, STOPS, BROKEN, ABSORBED = 16, 5, 9, 11
REWORDED = MOD_V1.replace("# bug: subtraction", "# bug: subtraction, still")
FIXED = MOD_V1.replace("return a - b  # bug: subtraction", "return a + b  # upstream")


@pytest.fixture
def history(fx: Fixture) -> Fixture:
    git("tag", "v2.0.0", "v1.0.0", cwd=fx.upstream)
    standard_stack(fx, tag="v2.0.0")
    work = fx.tmp / "work"
    git("checkout", "-q", "--detach", "v2.0.0", cwd=work)
    for i in range(1, N):
        subject = f"c{i}: counter"
        (work / "vllm" / "counter.py").write_text(f"N = {i}\n")
        if i == STOPS:
            (work / "vllm" / "mod.py").write_text(REWORDED)
            subject = f"c{i}: reword the comment in add()"
        if i == BROKEN:
            (work / "vllm" / "__init__.py").write_text("raise ImportError('broken')\n")
            subject = f"c{i}: break the package"
        if i == BROKEN + 1:
            (work / "vllm" / "__init__.py").write_text("")
        if i == ABSORBED:
            (work / "vllm" / "mod.py").write_text(FIXED)
            subject = f"c{i}: fix add() upstream"
        git("add", "-A", cwd=work)
        git("commit", "-q", "-m", subject, cwd=work)
        git("push", "-q", str(fx.upstream), f"HEAD:refs/tags/v2.0.{i}", cwd=work)
    return fx


def probes(out: str) -> tuple[list[str], list[str]]:
    """The bases probed, as printed: for applying, for the regression."""
    applied, regr = [], []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("probe "):
            rev = line.split()[1].rstrip(":")
            (applied if ": apply: " in line else regr).append(rev)
    return applied, regr


def test_culprit_over_releases(history: Fixture) -> None:
    out = history.tmp / "c.json"
    p = history.run(
        "status", "--releases", "v2.0.0..v2.0.15", "--repo", str(history.upstream),
        "--culprit", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    assert rep["bases"] == [f"v2.0.{i}" for i in range(N)]
    add, scale = rep["patches"]
    assert add["stops_applying"]["answer"] == "found"
    assert add["stops_applying"]["first"] == f"v2.0.{STOPS}"
    assert add["stops_applying"]["last_before"] == f"v2.0.{STOPS - 1}"
    assert add["absorbed"]["answer"] == "found"
    assert add["absorbed"]["first"] == f"v2.0.{ABSORBED}"
    assert add["absorbed"]["last_before"] == f"v2.0.{ABSORBED - 1}"
    assert scale["stops_applying"]["answer"] == "never"
    assert scale["absorbed"]["answer"] == "never"
    # bisection, not a sweep: about log2(n) probes per question
    bound = math.ceil(math.log2(N)) + 2
    for r in rep["patches"]:
        for key in ("stops_applying", "absorbed"):
            assert len(r[key]["probed"]) <= bound, (r["file"], key, r[key])
    applied, regr = probes(p.stdout)
    assert len(applied) == len(set(applied)) <= 2 * bound  # each base once
    assert len(applied) < N and len(regr) < N
    assert set(applied) == set(rep["probes"]["apply"])
    # the broken build was probed, could not tell, and a neighbour decided
    assert f"v2.0.{BROKEN}" in add["absorbed"]["probed"]
    broken = [x for x in rep["probes"]["regression"]
              if x["base"] == f"v2.0.{BROKEN}"]
    assert broken and broken[0]["verdict"] == "error"
    assert "ImportError: broken" in broken[0]["reason"]
    assert f"fx/0001: stops applying at v2.0.{STOPS} (applies at v2.0.{STOPS - 1})" \
        in p.stdout
    assert (f"fx/0001: bug absorbed at v2.0.{ABSORBED} (regression tests fail at "
            f"v2.0.{ABSORBED - 1})") in p.stdout
    assert "not in the range (applies at v2.0.15)" in p.stdout


def test_culprit_over_commits_names_the_commit(history: Fixture) -> None:
    up = history.upstream
    p = history.run("status", "--commits", "v2.0.3..v2.0.12", "--repo", str(up),
                    "--culprit")
    assert p.returncode == 0, p.stdout + p.stderr
    stops = git("rev-parse", f"v2.0.{STOPS}", cwd=up)
    fixed = git("rev-parse", f"v2.0.{ABSORBED}", cwd=up)
    assert f"fx/0001: stops applying at {stops} c{STOPS}: reword the comment in " \
           "add()" in p.stdout
    assert f"fx/0001: bug absorbed at {fixed} c{ABSORBED}: fix add() upstream" \
        in p.stdout
    applied, regr = probes(p.stdout)
    assert len(applied) < 10 and len(regr) < 10  # of 10 commits
    # a sub-range that starts after the change: 'at or before' its start
    p = history.run("status", "--commits", f"v2.0.{STOPS + 2}..v2.0.{STOPS + 3}",
                    "--repo", str(up), "--culprit", "--stack", "fx")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"at or before {git('rev-parse', f'v2.0.{STOPS + 2}', cwd=up)[:12]}" \
        in p.stdout


def test_culprit_all_cannot_tell_is_said(history: Fixture) -> None:
    # only the broken base, and one that cannot run the tests either
    p = history.run("status", "--bases", f"v2.0.{BROKEN},v9.9.9", "--repo",
                    str(history.upstream), "--culprit")
    assert p.returncode == 2  # an unknown revision in the user's repo
    p = history.run("status", "--bases", f"v2.0.{BROKEN}", "--repo",
                    str(history.upstream), "--culprit", "--json",
                    str(history.tmp / "c.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    add = json.loads((history.tmp / "c.json").read_text())["patches"][0]
    assert add["absorbed"]["answer"] == "unknown"
    assert "cannot tell in the range" in p.stdout
    assert f"fx/0001: bug absorbed: cannot tell at v2.0.{BROKEN}: " in p.stdout


def test_commits_needs_repo(history: Fixture) -> None:
    p = history.run("status", "--commits", "v2.0.0..v2.0.3", "--culprit")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "apply.py: error: --commits needs --repo (a vLLM git clone)"]


def test_first_change_unit() -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from applylib.culprit import first_change

    for n in (1, 2, 3, 16, 19, 100):
        for k in range(n + 1):  # every place of the change, and none
            seen = []

            def probe(i: int, k: int = k, seen: list = seen) -> bool:
                seen.append(i)
                return i < k

            got = first_change(n, probe)
            assert (got["last_same"], got["first_changed"]) == (k - 1, k)
            assert len(seen) <= math.ceil(math.log2(n + 1)) + 1
    # errors (None) are skipped; a block of them at either end is crossed
    # in log steps, and the change is still found
    for states, want in (([True] * 3 + [False] * 4 + [None] * 12, (2, 3)),
                         ([None] * 6 + [True] * 3 + [False] * 10, (8, 9))):
        got = first_change(len(states), lambda i, s=states: s[i])
        assert (got["last_same"], got["first_changed"]) == want
        assert len(got["probed"]) <= 6, got
    # nothing but errors above the last 'True': cannot tell after it
    states = [True] * 5 + [None] * 6
    got = first_change(len(states), lambda i: states[i])
    assert got["last_same"] == 4 and got["first_changed"] == len(states)
    assert got["cannot_tell"] == list(range(5, 11)) and got["not_probed"] == []
    # ... and with a budget of skips, it stops and says what it did not probe
    states = [True] * 5 + [None] * 14
    got = first_change(len(states), lambda i: states[i], max_skips=4)
    assert got["last_same"] == 4 and got["first_changed"] == len(states)
    assert len(got["cannot_tell"]) == 4 and len(got["not_probed"]) == 10
    assert sorted(got["cannot_tell"] + got["not_probed"]) == list(range(5, 19))
