"""applylib.warm: pytest runs forked from a warm interpreter answer as
`python -m pytest` in a subprocess would: each run imports vLLM from its
own tree, with its own environment and directory; exit codes, output and
timeouts are the run's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, Fixture, standard_stack

from applylib import warm

TEST = '''\
import os, time
import vllm


def test_tree():
    assert vllm.WHERE == os.environ["WANT"], vllm.WHERE
    print("tree", vllm.WHERE, os.getcwd())


def test_slow():
    if os.environ.get("PIDFILE"):
        with open(os.environ["PIDFILE"], "w") as fh:
            fh.write(str(os.getpid()))
    time.sleep(float(os.environ.get("SLEEP", "0")))
'''


def project(tmp: Path, name: str) -> tuple[Path, Path]:
    """A project with the test above, and a 'tree' whose vllm says `name`."""
    proj, tree = tmp / f"proj-{name}", tmp / f"tree-{name}"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text(f"WHERE = {name!r}\n")
    proj.mkdir()
    (proj / "test_w.py").write_text(TEST)
    return proj, tree


def run(proj: Path, tree: Path, want: str, *args: str, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(tree), WANT=want, **env)
    argv = ["-q", "-p", "no:cacheprovider", "-s", *args, "test_w.py"]
    return warm.run_pytest(sys.executable, argv, proj, full, timeout)


def test_each_run_imports_vllm_from_its_own_tree(tmp_path: Path) -> None:
    first, second = project(tmp_path, "a"), project(tmp_path, "b")
    p = run(*first, "a", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert f"tree a {first[0]}" in p.stdout
    # the same lane's server: vllm was not kept from the run before
    p = run(*second, "b", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert f"tree b {second[0]}" in p.stdout
    p = run(*second, "a", "-k", "tree")  # its own check fails: exit 1
    assert p.returncode == 1 and "AssertionError: b" in p.stdout, p.stdout


def test_timeout_kills_the_run(tmp_path: Path) -> None:
    proj, tree = project(tmp_path, "t")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run(proj, tree, "t", "-k", "slow", timeout=3, SLEEP="60")
    assert time.monotonic() - t0 < 30
    p = run(proj, tree, "t", "-k", "tree")  # the server still answers
    assert p.returncode == 0, p.stdout


def test_a_server_that_died_is_replaced(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that died between two runs (before the lane noticed) costs
    its warm modules, not the run: the run goes to a new server."""
    proj, tree = project(tmp_path, "d")
    assert run(proj, tree, "d", "-k", "tree").returncode == 0
    server = warm._local.server
    server.proc.kill()
    server.proc.wait()
    monkeypatch.setattr(server.proc, "poll", lambda: None)  # not noticed yet
    p = run(proj, tree, "d", "-k", "tree")
    assert p.returncode == 0, p.stdout
    assert warm._local.server is not server


def started(pidfile: Path, within: float = 60) -> int:
    """The pid the slow test wrote, once it is running."""
    end = time.monotonic() + within
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() < end, "the slow run never started"
        time.sleep(0.1)
    return int(pidfile.read_text())


def gone(pid: int, within: float = 10) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as fh:  # a zombie is gone too
            if fh.read().split(")")[-1].split()[0] == "Z":
                return True
        time.sleep(0.1)
    return False


def test_stop_all_ends_the_run_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply.py interrupted (Ctrl-C, SIGTERM): ``stop_all`` ends the run a
    lane is waiting on within seconds (the server kills its process group,
    not only itself), the lane gets ``Interrupted``, and no run starts
    after."""
    monkeypatch.setattr(warm, "_stopping", threading.Event())
    proj, tree = project(tmp_path, "s")
    pidfile = tmp_path / "pid"
    raised: list[BaseException] = []

    def lane() -> None:
        try:
            run(proj, tree, "s", "-k", "slow", SLEEP="120", PIDFILE=str(pidfile))
        except BaseException as e:  # noqa: BLE001 (what the lane would see)
            raised.append(e)

    t = threading.Thread(target=lane, daemon=True)
    t.start()
    pid = started(pidfile)
    t0 = time.monotonic()
    warm.stop_all()
    t.join(15)
    assert not t.is_alive() and time.monotonic() - t0 < 15
    assert raised and isinstance(raised[0], warm.Interrupted), raised
    assert gone(pid), f"the run {pid} outlived its server"
    with pytest.raises(warm.Interrupted):
        run(proj, tree, "s", "-k", "tree")


CALLER = """
import os, sys, threading
from pathlib import Path
from applylib import warm
proj, tree, pidfile = sys.argv[1:4]
env = dict(os.environ, PYTHONPATH=tree, WANT="k", SLEEP="120", PIDFILE=pidfile)
warm.run_pytest(sys.executable, ["-q", "-p", "no:cacheprovider", "-k", "slow",
                "test_w.py"], Path(proj), env, 300)
"""


def test_a_killed_caller_takes_its_run_along(tmp_path: Path) -> None:
    """apply.py killed outright (SIGKILL: no handler runs): its warm
    server notices its caller is gone and ends the run it forked."""
    proj, tree = project(tmp_path, "k")
    pidfile = tmp_path / "pid"
    root = Path(__file__).resolve().parents[2]
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(proj), str(tree), str(pidfile)],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
    )  # fmt: skip
    pid = 0
    try:
        pid = started(pidfile)
        caller.kill()
        caller.wait()
        assert gone(pid), f"the run {pid} outlived its caller"
    finally:
        caller.kill()
        if pid and not gone(pid, 0):  # a failure leaves nothing running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
SLOW_CONFTEST = """
import os, time
import pytest


@pytest.fixture(autouse=True)
def slow():
    if os.environ.get("FX_SLOW"):
        with open(f"{os.environ['FX_SLOW']}.{os.getpid()}", "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(120)
    yield
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_apply_interrupted_ends_its_runs(
    fx: Fixture, sig: signal.Signals, code: int
) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM while the
    targeted tests run: apply.py exits 130 / 143 within seconds with one
    line and no traceback, every test run it started is gone, and the next
    run passes."""
    standard_stack(fx)
    conftest = fx.project / "tests" / "patches" / "conftest.py"
    conftest.write_text(conftest.read_text() + SLOW_CONFTEST)
    marks = fx.tmp / "running"
    env = dict(os.environ, VLLM_PATCHES_CACHE=str(fx.cache), VLLM_PATCHES_OFFLINE="1",
               FX_SLOW=str(marks))  # fmt: skip
    # Ctrl-C's default action back (a background job inherits it ignored)
    cmd = [sys.executable, "-c", DEFAULT_SIGINT, str(ROOT / "apply.py"),
           "--series", str(fx.series), "--python", sys.executable,
           "--repo", str(fx.upstream)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=fx.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        end = time.monotonic() + 120
        while not pids:
            assert time.monotonic() < end and proc.poll() is None, "no run started"
            time.sleep(0.2)
            pids = [int(p.read_text() or 0) for p in fx.tmp.glob("running.*")]
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        for pid in [proc.pid, *pids] if proc.poll() is None else pids:
            if pid and not gone(pid, 0):  # a failure leaves nothing running
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    assert proc.returncode == code, out + err
    assert err.strip().splitlines()[-1].startswith("apply.py: interrupted"), err
    assert "Traceback" not in out + err, err
    assert all(gone(p) for p in pids if p), "a test run outlived apply.py"
    p = fx.run("--repo", str(fx.upstream))
    assert p.returncode == 0, p.stdout + p.stderr
