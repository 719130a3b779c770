"""apply.py under faults, made to happen for real: a filesystem that fills
up, runs side by side on a new cache, a signal during the download, a
truncated wheel, bases that cannot be had. Each is exit 2 (130 / 143 for
an interrupt) with one line, nothing left running and the user's
repository unchanged, never a conflict, a failed test or a verdict."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    APPLY,
    FIXED_ADD,
    FIXED_BOTH,
    MOD_V11,
    REG_ADD,
    REG_SCALE,
    Fixture,
    git,
    git_on_path,
    standard_stack,
)
from test_apply import two_stacks
from test_deliver import make_wheel, wheel_files
from test_inputs import one_line_error
from test_warm import DEFAULT_SIGINT


@contextlib.contextmanager
def small_disk(where: Path, kb: int) -> Iterator[Path]:
    """A tmpfs of `kb` KB at `where` (root only: skipped elsewhere)."""
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs",
                        str(where)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {p.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    """Write a file until `disk` has no room left."""
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()


def repo_on(fx: Fixture, disk: Path) -> Path:
    """The fixture's upstream clone moved onto `disk`."""
    subprocess.run(["cp", "-a", str(fx.upstream), str(disk / "up")], check=True)
    return disk / "up"


def left_running(session: int) -> list[str]:
    """The processes of a session (a run started with start_new_session)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(stat.parent.name)
    return found


def interrupted(cmd: list[str], env: dict[str, str], cwd: Path,
                sig: signal.Signals, ready) -> tuple[int, str, list[str]]:
    """Run `cmd` in a session of its own; once `ready(proc)` returns, send
    `sig` as Ctrl-C does (SIGINT to the process group) or as a CI job's
    timeout does (SIGTERM to the process): (exit status, stderr, the
    session's processes still running half a second after it ended)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        ready(proc)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        time.sleep(0.5)
        return proc.returncode, out + err, left_running(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_repository_short_of_room_is_refused(fx: Fixture) -> None:
    """A repository on a filesystem with less than the run needs: exit 2
    before any work, naming it (before, the cache alone was checked and a
    full disk read as a conflict)."""
    standard_stack(fx)
    with small_disk(fx.tmp / "small", 4096) as disk:
        up = repo_on(fx, disk)
        fill(disk)
        p = fx.run("--repo", str(up))
    one_line_error(p, f"the repository {up}/.git has 0 MB free", "free space")


@pytest.mark.parametrize("warm", [False, True])
def test_repository_filling_up_is_a_fault(fx: Fixture, warm: bool) -> None:
    """The repository's disk is full while git writes there (no room check:
    $VLLM_PATCHES_MIN_FREE_MB=0), on a new cache and on one a run has
    filled: exit 2 naming the repository, no conflict, the user's checkout
    unchanged, and a run after freeing space passes. (Before, git's "Out
    of diskspace" and the 3-way retry on the half-written file read as
    conflicts.)"""
    standard_stack(fx)
    env = {"VLLM_PATCHES_MIN_FREE_MB": "0"}
    with small_disk(fx.tmp / "small", 4096) as disk:
        up = repo_on(fx, disk)
        fx.upstream = up
        before = fx.snapshot()
        if warm:
            p = fx.run("--repo", str(up), "--no-tests", env=env)
            assert p.returncode == 0, p.stdout + p.stderr
        fill(disk)
        p = fx.run("--repo", str(up), env=env)
        one_line_error(p, "failed: the repository", f"{up}/.git has", "KB free")
        assert "conflict" not in p.stdout + p.stderr
        (disk / "filler").unlink()  # (git status needs room to run)
        assert fx.snapshot() == before
        p = fx.run("--repo", str(up), env=env)
        assert p.returncode == 0, p.stdout + p.stderr


def test_read_only_repository_is_a_fault(fx: Fixture) -> None:
    """The repository's filesystem mounted read-only: exit 2 naming it,
    never a conflict, with the room check (up front) and without it (git
    says so)."""
    standard_stack(fx)
    with small_disk(fx.tmp / "small", 4096) as disk:
        up = repo_on(fx, disk)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        p = fx.run("--repo", str(up), env={"VLLM_PATCHES_MIN_FREE_MB": "1"})
        one_line_error(p, f"the repository {up}/.git is on a read-only file")
        p = fx.run("--repo", str(up), env={"VLLM_PATCHES_MIN_FREE_MB": "0"})
        one_line_error(p, "Read-only file system")
        assert "conflict" not in p.stdout + p.stderr


def test_killed_git_is_a_fault(fx: Fixture) -> None:
    """A git am killed by a signal (the OOM killer, a stray kill): exit 2
    saying so; before, the 3-way retry was killed too and the patch was
    reported as a conflict (exit 1)."""
    standard_stack(fx)
    env = git_on_path(fx.tmp / "bin", "  kill -9 $$\n")
    one_line_error(fx.run("--repo", str(fx.upstream), env=env),
                   "git am was killed (SIGKILL)")


def release_stack(fx: Fixture) -> Path:
    """The fixture's stack pinned to release v1.0.0 (no repository): its
    base comes from a wheel in a find-links folder, as pip downloads it."""
    standard_stack(fx)
    fx.write_series(fx.series.read_text().replace(
        " repo=https://example.invalid/vllm", ""))
    whl = make_wheel(fx.tmp, "1.0.0", wheel_files(fx.upstream, "v1.0.0"))
    return whl


@pytest.mark.parametrize("runs", [2, 3])
def test_runs_side_by_side_on_a_new_cache(fx: Fixture, runs: int) -> None:
    """Two and three runs started at once on an empty cache all pass (one
    downloads the release, the others wait and say so), four times over.
    Before, one of two often failed in `git init` ("File exists", "could
    not lock config file") or on the import ref."""
    whl = release_stack(fx)
    cmd = [sys.executable, str(APPLY), "--series", str(fx.series), "--python",
           sys.executable]
    for n in range(4):
        env = dict(os.environ, VLLM_PATCHES_CACHE=str(fx.tmp / f"cache{n}"),
                   PIP_NO_INDEX="1", PIP_FIND_LINKS=str(whl.parent),
                   VLLM_PATCHES_OFFLINE="1")
        procs = [subprocess.Popen(cmd, env=env, cwd=fx.tmp, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(runs)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, out + err
            assert "== stack fx on v1.0.0" in out, out


class StallingIndex(http.server.SimpleHTTPRequestHandler):
    """A find-links page whose wheel download never ends."""

    def do_GET(self) -> None:
        name = Path(self.server.wheel).name
        if self.path.endswith(".whl"):
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(b"PK" + b"\0" * 65536)
            self.wfile.flush()
            time.sleep(60)
            return
        page = f'<html><body><a href="{name}">{name}</a></body></html>'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_during_the_download(fx: Fixture, sig: signal.Signals,
                                       code: int) -> None:
    """Ctrl-C (to the process group) or SIGTERM (to apply.py) while pip
    downloads the release: exit 130 / 143, one line, pip gone, no part of
    the wheel left in the cache; the next run passes. Before, SIGTERM left
    pip downloading."""
    whl = release_stack(fx)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StallingIndex)
    server.wheel = str(whl)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    env = dict(os.environ, VLLM_PATCHES_CACHE=str(fx.cache), PIP_NO_INDEX="1",
               PIP_FIND_LINKS=url, VLLM_PATCHES_OFFLINE="1", PIP_RETRIES="0")
    cmd = [sys.executable, "-c", DEFAULT_SIGINT, str(APPLY), "--series",
           str(fx.series), "--python", sys.executable]

    def downloading(proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "pip: Collecting" in line:
                break
        time.sleep(1)

    try:
        rc, err, running = interrupted(cmd, env, fx.tmp, sig, downloading)
    finally:
        server.shutdown()
    assert rc == code, err
    assert err.strip().splitlines()[-1].startswith("apply.py: interrupted"), err
    assert "Traceback" not in err, err
    assert not running, f"left running: {running}"
    assert not list((fx.cache / "dist").rglob("*.whl"))
    p = fx.run(env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(whl.parent)})
    assert p.returncode == 0, p.stdout + p.stderr


def test_truncated_wheel_as_base(fx: Fixture) -> None:
    """A wheel cut short (a download that stopped) given as the base:
    exit 2, one line naming it. Before, a BadZipFile traceback, exit 1."""
    whl = release_stack(fx)
    cut = fx.tmp / whl.name
    cut.write_bytes(whl.read_bytes()[: whl.stat().st_size // 2])
    one_line_error(fx.run("--base", str(cut), "--no-tests"), str(cut),
                   "not a whole wheel")


def test_pinned_release_wheel_is_the_pin(fx: Fixture) -> None:
    """The pin's release wheel given as the base is the pin: it is not
    downloaded again for the 3-way fallback (before, pip fetched the same
    release into the cache)."""
    whl = release_stack(fx)
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(whl.parent)}
    p = fx.run("--base", str(whl), "--no-tests", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "downloading" not in p.stderr, p.stderr
    assert not list((fx.cache / "dist").glob("*.whl"))


@pytest.mark.parametrize("args", [
    ("--stack", "fx", "--base", "nosuchthing"),
    ("--stack", "fx", "--base", "deadbeef"),
    ("--stack", "fx", "--base", "v1.0.0x"),
])
def test_unknown_base_without_a_clone(fx: Fixture, args: tuple[str, ...]) -> None:
    """A revision nothing at hand has, without --repo, its remote out of
    reach: exit 2 naming it (before: "SKIPPED, not verified", exit 1, a
    hint naming the pin)."""
    standard_stack(fx)
    p = fx.run(*args, env={"VLLM_PATCHES_OFFLINE": ""})
    one_line_error(p, f"unknown revision '{args[-1]}'", "give --repo")


def test_unknown_base_in_a_clone_says_nothing_else(fx: Fixture) -> None:
    """--repo R --base v9.9.9: the error alone, no stack chosen first."""
    two_stacks(fx)
    one_line_error(fx.run("--repo", str(fx.upstream), "--base", "v9.9.9"),
                   "unknown revision 'v9.9.9'")


def test_patch_for_a_missing_component_is_not_applicable(fx: Fixture) -> None:
    """Between two pins, a patch of the newer stack that changes a file
    the base does not have (UltraQuant's on a release before it) is "not
    applicable", not one that needs a port, and the stack whose other
    patches apply is taken."""
    two_stacks(fx)
    work = fx.tmp / "uq"
    git("clone", "-q", str(fx.upstream), str(work), cwd=fx.tmp)
    git("checkout", "-q", "--detach", "v1.1.0", cwd=work)
    (work / "vllm" / "uq.py").write_text("X = 1\n")
    git("add", "vllm/uq.py", cwd=work)
    git("commit", "-q", "-m", "v1.2.0: UltraQuant", cwd=work)
    git("push", "-q", str(fx.upstream), "HEAD:refs/tags/v1.2.0", cwd=work)
    git("fetch", "-q", "origin", "--tags", cwd=fx.tmp / "work")
    fx.make_patch("old/0001-fix-add.patch", {"vllm/mod.py": FIXED_ADD},
                  "[Core] Fix add", [REG_ADD], base="v1.0.0")
    fx.make_patch("old/0002-fix-scale.patch", {"vllm/mod.py": FIXED_BOTH},
                  "[Core] Fix scale", [REG_SCALE])  # conflicts on v1.1.0
    fixed_v11 = MOD_V11.replace("return a - b  # bug: subtraction", "return a + b")
    fx.make_patch("new/0001-fix-add.patch", {"vllm/mod.py": fixed_v11},
                  "[Core] Fix add", [REG_ADD], base="v1.2.0")
    fx.make_patch("new/0002-fix-uq.patch", {"vllm/uq.py": "X = 2\n"},
                  "[UQ] Fix X", [REG_ADD])
    fx.write_series(
        "#@ stack old repo=https://example.invalid/vllm tag=v1.0.0\n"
        "old/0001-fix-add.patch\nold/0002-fix-scale.patch\n"
        "#@ stack new repo=https://example.invalid/vllm tag=v1.2.0\n"
        "new/0001-fix-add.patch\nnew/0002-fix-uq.patch\n")
    p = fx.run("--repo", str(fx.upstream), "--no-tests", "--base", "v1.1.0")
    assert ("'new': 1 of 2 patches apply; new/0002 not applicable (no "
            "vllm/uq.py there)") in p.stderr, p.stderr
    assert "using stack 'new', which applies where it can" in p.stderr, p.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_during_the_apply(fx: Fixture, sig: signal.Signals,
                                    code: int) -> None:
    """Ctrl-C or SIGTERM while git am runs: exit 130 / 143 with one line,
    no git left, the user's checkout unchanged, and the next run passes
    (never a conflict read from the killed am)."""
    standard_stack(fx)
    bindir = fx.tmp / "bin"
    env_git = git_on_path(bindir, f'  touch {fx.tmp}/in-am; exec sleep 60\n')
    before = fx.snapshot()
    env = dict(os.environ, VLLM_PATCHES_CACHE=str(fx.cache),
               VLLM_PATCHES_OFFLINE="1", **env_git)
    cmd = [sys.executable, "-c", DEFAULT_SIGINT, str(APPLY), "--series",
           str(fx.series), "--python", sys.executable, "--repo", str(fx.upstream)]

    def in_am(proc: subprocess.Popen) -> None:
        end = time.monotonic() + 60
        while not (fx.tmp / "in-am").exists():
            assert time.monotonic() < end and proc.poll() is None, "no git am"
            time.sleep(0.1)

    rc, err, running = interrupted(cmd, env, fx.tmp, sig, in_am)
    assert rc == code, err
    assert err.strip().splitlines() == [
        "apply.py: interrupted; the next run clears what this one left in its "
        "cache"], err
    assert not running, f"left running: {running}"
    assert fx.snapshot() == before
    p = fx.run("--repo", str(fx.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
