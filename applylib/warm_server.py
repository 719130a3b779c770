"""A warm interpreter for pytest runs (run by warm.py under the test Python).

Each request (one JSON line on stdin) is run in a child forked from this
process: the child takes the request's environment, directory and
``sys.path`` (its ``PYTHONPATH``), sends its output to the request's file
and calls ``pytest.main``; its exit status is the answer (one JSON line on
stdout). After each run this process imports the third-party modules the
child had imported from the standard library or the installed packages (never
vLLM, the tree under test, the project or the run's scratch folder), so
the next child finds them loaded: vLLM's own modules are always imported
fresh, from the tree the request names.

It stops preloading, and says so, if an import started a thread (a fork
would copy a lock another thread holds); it exits when stdin closes. It
ignores Ctrl-C (its caller decides); on SIGTERM, or when its caller is gone,
it ends the running child's process group first, then itself.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import sysconfig
import threading
import time

LEARNED = "VLLM_PATCHES_WARM_MODULES"
RUNNING: list[int] = []  # the process group of the run in progress


def stop(signum: int = signal.SIGTERM, frame: object = None) -> None:
    """End the run in progress and whatever it started, then this process."""
    for pid in RUNNING:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os._exit(128 + signum)


def child(req: dict) -> None:
    os.setpgrp()  # a timeout kills the run and whatever it started
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    paths = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [req["cwd"], *paths]  # as `python -m pytest` in cwd
    code = 3
    try:
        import pytest

        code = int(pytest.main(req["argv"]))
    finally:
        with open(req["modules"], "w") as fh:
            json.dump({"modules": third_party(), "environ": dict(os.environ)}, fh)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def third_party() -> list[str]:
    """The modules loaded now that come from the standard library or the
    installed packages (site-packages), and are no vLLM module."""
    roots = tuple(
        os.path.realpath(sysconfig.get_paths()[k]) + os.sep
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
    )
    out = []
    for name, mod in list(sys.modules.items()):
        path = os.path.realpath(getattr(mod, "__file__", None) or "/")
        if name.split(".", 1)[0] != "vllm" and path.startswith(roots):
            out.append(name)
    return out


def preload(names: list[str], environ: dict[str, str] | None = None) -> bool:
    """Import `names` under `environ` (the run's, as it ended: what its
    imports saw, such as the TRITON_INTERPRET its conftest set; Triton
    decides at decoration time whether a kernel is interpreted)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update({k: v for k, v in environ.items() if k != "PYTHONPATH"})
    for name in names:
        if name in sys.modules:
            continue
        with contextlib.suppress(Exception):  # one that needs the run's state
            importlib.import_module(name)
    return threading.active_count() == 1


def wait(pid: int, timeout: float, caller: int) -> int | None:
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if os.getppid() != caller:  # the caller was killed: nobody to answer
            stop()
        if time.monotonic() > end:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def main() -> None:
    caller = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    warm = preload(["pytest"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)
        RUNNING[:] = [pid]
        code = wait(pid, req["timeout"], caller)
        RUNNING.clear()
        learned = None
        if warm and os.path.exists(req["modules"]):
            with open(req["modules"]) as fh:  # read before the answer: the
                learned = json.load(fh)  # caller then removes the folder
        # answer, then preload for the next run while the caller goes on
        print(json.dumps({"rc": code, "warm": warm}), flush=True)
        if learned is not None:
            warm = preload(learned["modules"], learned["environ"])


if __name__ == "__main__":
    main()
