"""apply.py status --installed: the vLLM installed in a Python environment.

Fixture part (fast): test_deliver's three-patch stack 'fx' on a small
vLLM-like release 1.0.0; its "official" wheel and the patched wheel from
apply.py wheel are installed with pip into a fresh virtual environment (its
own site-packages empty, the test environment's packages behind it through
a .pth file, so it has pytest as a developer's venv might).

Real part (marked slow: VLLM_PATCHES_SLOW=1 or -m slow): the official vLLM
0.20.2 wheel installed --no-deps over the test environment's torch, then the
wheel apply.py builds from this project's tq stack installed over it, then
one of its files altered by hand. The regression tests take minutes there
(the Triton interpreter on CPU), and the venv and wheel another two; without
them, the real release's patched wheel is still checked by status
--installed in test_deliver's serving-image recipe.

Every run checks that nothing was written into the inspected environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Fixture, git, isolated_cache
from test_deliver import (  # noqa: F401  (dx is a fixture)
    FIX_BOTH,
    dx,
    make_wheel,
    run_tool,
    wheel_files,
)

PY = sys.executable
TQ = "vllm/v1/attention/backends/tq.py"
FX = ["fx/0001", "fx/0002", "fx/0003"]


def make_venv(tmp: Path) -> tuple[str, Path]:
    """A fresh venv: its own site-packages empty, the test environment's
    packages (torch, pytest, pip) behind it through a .pth file."""
    venv = tmp / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    test_site = next(p for p in sys.path if p.endswith("site-packages")
                     and (Path(p) / "pytest").is_dir())
    (site / "test-env.pth").write_text(test_site + "\n")
    return str(venv / "bin" / "python"), site


def pip_install(python: str, whl: Path) -> float:
    t0 = time.monotonic()
    p = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-compile", "--disable-pip-version-check", str(whl)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return time.monotonic() - t0


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.join(dirpath, n)] = (st.st_size, st.st_mtime_ns)
    return out


def status(fx_cache: Path, cwd: Path, *args: str, env: dict | None = None,
           venv_site: Path | None = None) -> tuple[subprocess.CompletedProcess,
                                                   dict | None]:
    """status --installed, checking that the environment is left as it was."""
    before = listing(venv_site.parents[2]) if venv_site else None
    out = cwd / "status.json"
    out.unlink(missing_ok=True)
    p = run_tool("status", "--installed", *args, "--json", str(out),
                 cache=fx_cache, cwd=cwd, env=env, timeout=1800)
    if venv_site:
        after = listing(venv_site.parents[2])
        assert after == before, sorted(set(after) ^ set(before))[:5]
    return p, json.loads(out.read_text()) if out.exists() else None


def cells(rep: dict) -> dict[str, tuple[str, str]]:
    return {p["file"].split("-", 1)[0]: (p["installed"], p["bug"])
            for st in rep["stacks"] for p in st["patches"]}


@pytest.fixture
def fxenv(dx: Fixture) -> dict:  # noqa: F811
    """dx's release 1.0.0 wheel installed with pip into a fresh venv."""
    src = make_wheel(dx.tmp, "1.0.0", wheel_files(dx.upstream, "v1.0.0"),
                     commit=git("rev-parse", "v1.0.0", cwd=dx.upstream)[:9])
    python, site = make_venv(dx.tmp)
    pip_install(python, src)
    return {"fx": dx, "src": src, "python": python, "site": site,
            "series": str(dx.series)}


def test_fixture_release_patched_wheel_and_altered(fxenv: dict) -> None:
    dx, python, site = fxenv["fx"], fxenv["python"], fxenv["site"]
    base = ("--series", fxenv["series"], "--python", python)
    # the release as published: every patch absent, every bug present
    p, rep = status(dx.cache, dx.tmp, *base, "--repo", str(dx.upstream),
                    venv_site=site)
    assert p.returncode == 1, p.stdout + p.stderr
    assert cells(rep) == {k: ("absent", "present") for k in FX}
    assert rep["vllm"]["version"] == "1.0.0" and rep["wheel"] is None
    assert rep["vllm"]["upstream_commit"] == git("rev-parse", "v1.0.0",
                                                 cwd=dx.upstream)[:9]
    assert rep["stacks"][0]["reference"]["kind"] == "patched tree"
    assert rep["tests"] == {"python": python, "in_place": True, "ran": True}
    assert "not made by apply.py wheel" in p.stdout
    assert "result: 0 of 3 patches in effect" in p.stdout
    # the patched wheel from apply.py wheel, installed over it
    out = dx.tmp / "out"
    w = dx.run("wheel", "--repo", str(dx.upstream), "--from-wheel",
               str(fxenv["src"]), "--out", str(out))
    assert w.returncode == 0, w.stdout + w.stderr
    whl = next(out.glob("*.whl"))
    pip_install(python, whl)
    version = whl.name.split("-")[1]
    p, rep = status(dx.cache, dx.tmp, *base, venv_site=site)
    assert p.returncode == 0, p.stdout + p.stderr
    assert cells(rep) == {k: ("in-effect", "absent") for k in FX}
    assert rep["stacks"][0]["reference"]["kind"] == "wheel manifest"
    assert (f"installed from vllm-{version} (apply.py wheel): stack fx, series "
            "digest ") in p.stdout
    assert "(the same as this series'), all 4 files as built" in p.stdout
    assert rep["imports"]["failed"] == {} and len(rep["imports"]["ok"]) == 3
    # the same, the tests run by the test Python with only vllm taken from
    # the venv, and with git unusable (a serving image may lack it)
    nogit = dx.tmp / "nogit"
    nogit.mkdir()
    (nogit / "git").write_text("#!/bin/sh\necho 'git: not here' >&2\nexit 127\n")
    (nogit / "git").chmod(0o755)
    p, rep = status(dx.cache, dx.tmp, *base, "--no-tests",
                    env={"PATH": f"{nogit}:{os.environ['PATH']}"}, venv_site=site)
    assert p.returncode == 0, p.stdout + p.stderr
    assert cells(rep) == {k: ("in-effect", "not run") for k in FX}
    p, rep = status(dx.cache, dx.tmp, *base, "--test-python", PY, venv_site=site)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["tests"]["in_place"] is False
    assert cells(rep) == {k: ("in-effect", "absent") for k in FX}
    assert "only its vllm package" in p.stdout
    # altered by hand: one file changed (two patches share it), another
    # put back to the release's content
    (site / "vllm" / "mod.py").write_text(FIX_BOTH + "# hotfix by hand\n")
    (site / TQ).write_text("THRESHOLD = 128\n")
    p, rep = status(dx.cache, dx.tmp, *base, venv_site=site)
    assert p.returncode == 1, p.stdout + p.stderr
    assert cells(rep) == {"fx/0001": ("modified", "present"),
                          "fx/0002": ("modified", "absent"),
                          "fx/0003": ("modified", "absent")}
    assert f"fx/0001: modified: {TQ} (the release's content)" in p.stdout
    assert ("fx/0002: modified: vllm/mod.py (neither the patched nor the "
            "release's content)") in p.stdout
    assert ("2 of 4 files as built; differ from the wheel's RECORD: vllm/mod.py, "
            f"{TQ}") in p.stdout
    # the series moved on since the wheel was built: judged against the
    # stack applied on the release (same content: still in effect)
    (site / "vllm" / "mod.py").write_text(FIX_BOTH)
    (site / TQ).write_text("THRESHOLD = 64\n")
    patch = dx.project / "patches" / "fx" / "0002-fix-add.patch"
    text = patch.read_text()
    assert "\nThe fix.\n" in text
    patch.write_text(text.replace("\nThe fix.\n", "\nThe fix, again.\n"))
    p, rep = status(dx.cache, dx.tmp, *base, "--repo", str(dx.upstream),
                    "--no-tests", venv_site=site)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["stacks"][0]["reference"]["kind"] == "patched tree"
    assert "(NOT this series'), all 4 files as built" in p.stdout
    assert cells(rep) == {k: ("in-effect", "not run") for k in FX}


def test_fixture_bad_input_and_no_stack(fxenv: dict) -> None:
    dx, python = fxenv["fx"], fxenv["python"]
    series = ("--series", fxenv["series"])

    def one_line(p: subprocess.CompletedProcess, text: str) -> None:
        assert p.returncode == 2, p.stdout + p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], p.stderr

    run = lambda *a: status(dx.cache, dx.tmp, *series, *a)[0]  # noqa: E731
    one_line(run("--python", str(dx.tmp / "nope" / "python")),
             "cannot run the Python")
    one_line(run("--python", PY), f"no vLLM installed in {PY}")
    one_line(run("--python", python, "--stack", "nope"), "unknown stack 'nope'")
    one_line(run("--python", python, "--bases", "v1.0.0"),
             "--installed takes no --bases")
    one_line(run_tool("status", "--no-tests", "--bases", "v1.0.0", *series,
                      cache=dx.cache, cwd=dx.tmp), "go with --installed")
    # without a repository: the release's base from its wheel in the cache
    (dx.cache / "dist").mkdir(parents=True, exist_ok=True)
    (dx.cache / "dist" / fxenv["src"].name).write_bytes(fxenv["src"].read_bytes())
    p = run("--python", python, "--no-tests")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "judged against the stack applied on v1.0.0" in p.stdout
    assert "from pypi" in p.stdout  # materialized from the release's wheel
    # a release no stack pins: said, nothing to check
    text = Path(fxenv["series"]).read_text().replace("tag=v1.0.0", "tag=v0.9.0")
    Path(fxenv["series"]).write_text(text)
    p = run("--python", python)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("no stack of the series is pinned to release 1.0.0: nothing to check "
            "(the newest stack below it is 'fx', pinned to v0.9.0: --stack fx "
            "checks it against this release)") in p.stdout
    p = run("--python", python, "--stack", "fx", "--repo", str(dx.upstream),
            "--no-tests")
    assert p.returncode == 1 and "absent" in p.stdout, p.stdout + p.stderr


# --------------------------------------------------------------------------
# the real vLLM 0.20.2 and the wheel apply.py builds from the tq stack


@pytest.fixture(scope="module")
def real_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fresh venv with the official vLLM 0.20.2 wheel (from the tool's
    cache, pip once) installed --no-deps over the test environment's
    torch; a cache of its own sharing the release wheels."""
    tmp = tmp_path_factory.mktemp("installed")
    cache = isolated_cache(tmp)
    p = run_tool("base", "--stack", "tq", "--series", str(ROOT / "series"),
                 cache=cache, cwd=tmp, timeout=1800)
    assert p.returncode == 0, p.stderr
    official = sorted((cache / "dist").glob("vllm-0.20.2-*.whl"))[0]
    python, site = make_venv(tmp)
    secs = pip_install(python, official)
    print(f"\nvenv + pip install {official.name}: {secs:.1f} s")
    return {"tmp": tmp, "cache": cache, "python": python, "site": site,
            "official": official}


@pytest.fixture(scope="module")
def real_patched(real_env: dict) -> dict:
    """The same venv after pip install --no-deps of apply.py wheel's tq wheel."""
    tmp = real_env["tmp"]
    t0 = time.monotonic()
    p = run_tool("wheel", "--stack", "tq", "--series", str(ROOT / "series"),
                 "--out", str(tmp / "dist"), cache=real_env["cache"], cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    whl = Path(p.stdout.splitlines()[0])
    secs = pip_install(real_env["python"], whl)
    print(f"\napply.py wheel: {time.monotonic() - t0 - secs:.1f} s; pip install "
          f"{whl.name}: {secs:.1f} s")
    return {**real_env, "wheel": whl, "version": whl.name.split("-")[1]}


def real_status(env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    t0 = time.monotonic()
    p, rep = status(env["cache"], env["tmp"], "--series", str(ROOT / "series"),
                    "--python", env["python"], *args, venv_site=env["site"])
    print(f"\nstatus --installed {' '.join(args)}: {time.monotonic() - t0:.1f} s\n"
          + p.stdout)
    return p, rep


@pytest.mark.slow
def test_real_official_release(real_env: dict) -> None:
    """(a) the official 0.20.2: every tq patch absent, every bug present."""
    p, rep = real_status(real_env)
    assert p.returncode == 1, p.stdout + p.stderr
    tq = {k: v for k, v in cells(rep).items() if k.startswith("tq/")}
    assert tq == {k: ("absent", "present") for k in ("tq/0001", "tq/0002",
                                                     "tq/0003")}
    assert rep["vllm"]["version"] == "0.20.2"
    assert rep["vllm"]["upstream_commit"] == "bc150f502"
    assert rep["tests"]["in_place"] is True
    for st in rep["stacks"]:
        for q in st["patches"]:
            assert q["regression"]["verdict"] == "fail", q


@pytest.mark.slow
def test_real_patched_wheel(real_patched: dict) -> None:
    """(b) the wheel apply.py builds, installed over it: every tq patch in
    effect, every bug absent (the tests run by the test Python, only vllm
    taken from the venv)."""
    p, rep = real_status(real_patched, "--test-python", PY)
    assert p.returncode == 0, p.stdout + p.stderr
    assert cells(rep) == {k: ("in-effect", "absent") for k in ("tq/0001",
                                                               "tq/0002",
                                                               "tq/0003")}
    assert rep["tests"]["in_place"] is False
    assert (f"installed from vllm-{real_patched['version']} (apply.py wheel): "
            "stack tq") in p.stdout
    assert "all 4 files as built" in p.stdout


@pytest.mark.slow
def test_real_patched_file_altered(real_patched: dict) -> None:
    """(c) that venv with one patched file altered by hand: modified, named
    (files and imports only: the regression tests are (b)'s)."""
    p, rep = real_status(real_patched, "--no-tests")
    assert p.returncode == 0, p.stdout + p.stderr
    f = real_patched["site"] / "vllm" / "v1" / "attention" / "backends" / \
        "turboquant_attn.py"
    old = f.read_bytes()
    f.write_bytes(old + b"# altered by hand\n")
    try:
        p, rep = real_status(real_patched, "--no-tests")
    finally:
        f.write_bytes(old)
    assert p.returncode == 1, p.stdout + p.stderr
    modified = {k: v for k, v in cells(rep).items() if v[0] == "modified"}
    assert modified, p.stdout
    rel = "vllm/v1/attention/backends/turboquant_attn.py"
    for k in modified:
        assert f"{k}: modified: {rel} (neither the patched nor the release's " \
               "content)" in p.stdout
    assert f"differ from the wheel's RECORD: {rel}" in p.stdout
