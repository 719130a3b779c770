"""The real series: every active patch of every stack whose base is at hand
applies, its regression tests fail on the unpatched base and pass patched, and
its other targeted tests pass; a stack whose base cannot be had is reported as
skipped with the exact fetch command, never as passed; with the pinned files
of a stack assembled offline ($VLLM_PATCHES_FETCHED, as ci/test.sh sets it
where ../shared/fixtures/dsv4 exists), that stack is verified.

ci/test.sh runs the main job first (its table goes to the log) and hands the
report over in VLLM_PATCHES_REPORT; run alone, this test runs the main job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import APPLY, ROOT


def report(tmp_path: Path) -> dict:
    given = os.environ.get("VLLM_PATCHES_REPORT")
    if given and Path(given).is_file():
        return json.loads(Path(given).read_text())
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(APPLY), "--python", sys.executable,
                        "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600)
    print(p.stdout)
    assert out.exists(), p.stderr
    return json.loads(out.read_text())


def active_patches(stack: str) -> list[str]:
    out, cur = [], None
    for line in (ROOT / "series").read_text().splitlines():
        if line.startswith("#@ stack "):
            cur = line.split()[2]
        elif line.strip() and not line.startswith("#") and cur == stack:
            out.append(line.split()[0])
    return out


def test_real_series_report(tmp_path: Path) -> None:
    rep = report(tmp_path)
    names = [s["name"] for s in rep["stacks"]]
    assert names[0] == "tq"
    fetched = os.environ.get("VLLM_PATCHES_FETCHED")
    for st in rep["stacks"]:
        assert [p["file"] for p in st["patches"]] == active_patches(st["name"])
        if fetched and "assemble" in st["pins"]:
            # its pinned files are given: verified, never skipped
            assert st["status"] == "ran", st.get("reason")
        if st["status"] == "skipped":
            assert st["fetch"].startswith("git ")
            assert "fetch" in st["fetch"]
            assert all(p["apply"] == "skipped" for p in st["patches"])
            continue
        for p in st["patches"]:
            assert p["apply"] in ("clean", "3way"), p
            assert p["regression"] == {"base": "fail", "patched": "pass"}, p
            assert p["tests"] == "pass", p
    tq = rep["stacks"][0]
    assert tq["status"] == "ran"
    pin = tq["pins"]["commit"]
    assert tq["base_commit"] == pin or pin.startswith(tq.get("upstream_commit")
                                                      or "~")
    assert names[:2] == ["tq", "tq-v0.33"]
    assert rep["stacks"][1]["status"] == "ran"  # a release: always at hand
    assert rep["exit_code"] == 0


def test_bare_base_picks_the_stack_pinned_there(tmp_path: Path) -> None:
    """--base without --stack: the stack pinned to that release, else the one
    pinned to the newest release before it, else the first."""
    from applylib.series import parse_series

    s = tmp_path / "series"
    s.write_text(
        "#@ stack a repo=https://example.invalid/v tag=v0.20.2\n"
        "#@ stack b repo=https://example.invalid/v tag=v0.33.0\n"
        "#@ stack c repo=https://example.invalid/f branch=x commit="
        + "1" * 40 + "\n")
    series = parse_series(s, need_patches=False)
    picks = {b: series.pick_stack(None, b).name for b in (
        "v0.33.0", "v0.20.2", "v0.27.0", "v0.34.1", "v0.19.0", "abc123")}
    assert picks == {"v0.33.0": "b", "v0.20.2": "a", "v0.27.0": "a",
                     "v0.34.1": "b", "v0.19.0": "a", "abc123": "a"}
    assert series.pick_stack("c", "v0.33.0").name == "c"


def test_export_names_a_ported_patch_by_its_stack(tmp_path: Path) -> None:
    """A patch carried to a new stack keeps its file name; its PR branch and
    files are prefixed by the stack, so the two exports do not collide."""
    from applylib.export import export_stem
    from applylib.series import parse_series

    s = tmp_path / "series"
    s.write_text(
        "#@ stack a repo=https://example.invalid/v tag=v0.20.2\n"
        "a/0001-fix.patch\na/0002-other.patch\n"
        "#@ stack a-v0.33 repo=https://example.invalid/v tag=v0.33.0\n"
        "a-v0.33/0001-fix.patch\n")
    for f in ("a/0001-fix", "a/0002-other", "a-v0.33/0001-fix"):
        (tmp_path / "patches" / f"{f}.patch").parent.mkdir(parents=True,
                                                          exist_ok=True)
        (tmp_path / "patches" / f"{f}.patch").write_text("")
    series = parse_series(s, need_patches=False)
    assert export_stem(series, "a/0002-other.patch") == "a-0002-other"
    assert export_stem(series, "a/0001-fix.patch") == "a-0001-fix"
    assert export_stem(series, "a-v0.33/0001-fix.patch") == "a-v0.33-0001-fix"
