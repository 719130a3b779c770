"""Pytest runs forked from a warm interpreter, one per lane.

A run imports torch, Triton, transformers and the rest of what vLLM
imports (about 10 s on 2 cores; a mutant's test then takes a few
seconds): warm_server.py, started once per lane under the test Python,
forks each run from a process that has those loaded, while vLLM's own
modules are imported fresh in every run, from its tree. The output, exit
status and timeout are those of ``python -m pytest`` run in a subprocess.
``VLLM_PATCHES_WARM=0`` runs each in a fresh interpreter instead.
``stop_all`` (apply.py interrupted) ends every server and the run it forked,
and no new one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

from .core import say

SERVER = Path(__file__).with_name("warm_server.py")
_local = threading.local()
_servers: weakref.WeakSet[Server] = weakref.WeakSet()
_stopping = threading.Event()


class Interrupted(Exception):
    """A run asked for after ``stop_all``: the lane stops quietly."""


def stop_all() -> None:
    """Every warm interpreter ends, with the run it forked (SIGTERM: the
    server kills the run's process group first); none starts after."""
    _stopping.set()
    for server in list(_servers):
        server.close()


def enabled() -> bool:
    return os.environ.get("VLLM_PATCHES_WARM", "1") != "0" and hasattr(os, "fork")


class Server:
    """warm_server.py under `python`, answering one run at a time."""

    def __init__(self, python: str, env: dict[str, str]):
        self.python = python
        self.proc = subprocess.Popen(
            [python, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        # the lane's thread-local copy goes with its thread, and this with it
        self.close = weakref.finalize(self, shutdown, self.proc)
        _servers.add(self)
        self.answer()

    def answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise OSError(f"the warm interpreter under {self.python} exited")
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple:
        with tempfile.TemporaryDirectory(prefix="vllm-patches-warm-") as tmp:
            out, mods = Path(tmp, "output"), Path(tmp, "modules")
            req = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": timeout}
            req.update(out=str(out), modules=str(mods))
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            rc = self.answer()["rc"]
            output = out.read_text(errors="replace") if out.exists() else ""
        return rc, output


def shutdown(proc: subprocess.Popen) -> None:
    """Stop the server (it holds no state; it may be preloading): SIGTERM,
    on which it kills the run in progress, then SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):  # a request it never read
                pipe.close()


def run_pytest(
    python: str, argv: list[str], cwd: Path, env: dict, timeout: float
) -> subprocess.CompletedProcess:
    """`python -m pytest argv` in `cwd` with `env`, forked from this lane's
    warm interpreter; raises subprocess.TimeoutExpired as subprocess.run."""
    start = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if _stopping.is_set():
        raise Interrupted("apply.py was interrupted")
    server = getattr(_local, "server", None)
    if server is None or server.python != python or server.proc.poll() is not None:
        server = _local.server = Server(python, start)
    try:
        rc, output = server.run(argv, cwd, env, timeout)
    except OSError as e:  # it died: the run once more, from a new one
        if _stopping.is_set():
            raise Interrupted("apply.py was interrupted") from e
        say(f"apply.py: {e}; starting another")
        server.close()
        server = _local.server = Server(python, start)
        rc, output = server.run(argv, cwd, env, timeout)
    if rc is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=output)
    return subprocess.CompletedProcess(argv, rc, output, "")
