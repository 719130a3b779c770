"""An installed vLLM, read from outside: the Python of its environment
runs, with bytecode writing off and from a scratch directory, a script
that reports the vllm distribution and package as JSON. Nothing of the
environment is written or imported into the tool."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .core import UserError

VERSION = re.compile(r"^(\d+\.\d+\.\d+(?:\.post\d+)?)(?:\+(.+))?$")

# Run by the inspected Python: what it has, as JSON; imports nothing of vLLM.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
out = {"python": sys.executable, "prefix": sys.prefix,
       "has_pytest": importlib.util.find_spec("pytest") is not None}
spec = importlib.util.find_spec("vllm")
locs = list(spec.submodule_search_locations or []) if spec else []
out["package"] = locs[0] if locs else None
try:
    d = md.distribution("vllm")
except md.PackageNotFoundError:
    d = None
if d is not None:
    out["version"] = d.version
    out["location"] = str(d.locate_file(""))
    out["installer"] = (d.read_text("INSTALLER") or "").strip()
    out["manifest"] = d.read_text("vllm_patches.json")
    out["record"] = {str(f): f"{f.hash.mode}={f.hash.value}"
                     for f in (d.files or []) if f.hash}
print(json.dumps(out))
"""


def read_only_env() -> dict[str, str]:
    """The environment for the inspected interpreter: no bytecode written,
    no PYTHONPATH of ours in the way."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    return env


def run_inspected(python: str, script: str, *args: str, timeout: float = 600):
    with tempfile.TemporaryDirectory(prefix="vllm-patches-probe-") as cwd:
        try:
            return subprocess.run(
                [python, "-B", "-c", script, *args],
                cwd=cwd,
                env=read_only_env(),
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except OSError as e:
            raise UserError(f"cannot run the Python '{python}': {e}") from None


def probe(python: str) -> dict:
    """What `python` has installed: the vllm distribution and package."""
    proc = run_inspected(python, PROBE, timeout=120)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"'{python}' cannot report its packages: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def pick_python(arg: str | None) -> tuple[str, dict]:
    """--python, else the Python running apply.py when vLLM is installed
    there, else $VLLM_PATCHES_PYTHON."""
    tried = [arg] if arg else [sys.executable]
    if not arg and os.environ.get("VLLM_PATCHES_PYTHON"):
        tried.append(os.environ["VLLM_PATCHES_PYTHON"])
    for py in tried:
        info = probe(py)
        if info.get("package") and info.get("version"):
            return py, info
        if info.get("package") and arg:
            raise UserError(
                f"{py}: vllm imports from {info['package']}, but no vllm "
                "distribution is installed there (a source tree on its path? "
                "use 'apply.py test --tree' for a tree)"
            )
    raise UserError(
        f"no vLLM installed in {' or '.join(tried)} (give the environment's "
        "Python with --python PY)"
    )


def describe(python: str, info: dict) -> dict:
    """The installed vLLM: version, release, upstream commit, where."""
    pkg = Path(info["package"])
    version_py = pkg / "_version.py"
    text = version_py.read_text() if version_py.is_file() else ""
    m = re.search(r"__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'", text)
    v = VERSION.match(info["version"])
    out = {
        "python": python,
        "version": info["version"],
        "release": v.group(1) if v else None,
        "local": v.group(2) if v else None,
        "upstream_commit": m.group(1) if m else None,
        "package": str(pkg),
        "root": str(pkg.parent),
        "location": info.get("location"),
        "installer": info.get("installer") or None,
    }
    if (
        info.get("location")
        and Path(info["location"]).resolve() != pkg.parent.resolve()
    ):
        out["note"] = (
            f"the vllm that imports ({pkg}) is not the installed "
            f"distribution's ({info['location']})"
        )
    return out
