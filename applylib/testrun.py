"""Running targeted tests against a vLLM tree, and their verdicts.

A tree under test is the only vLLM every process of the run sees: the
tree's root and a minimal package metadata for it lead ``PYTHONPATH``, so
the subprocesses vLLM starts (model inspection, compile workers) import it
too, and vLLM's, Triton's and torch.compile's caches live in a folder of
the run's own, so nothing an earlier run, another tree or the developer's
home directory holds can change an outcome.

Verdicts (the pytest plugin in pytest_plugin.py gives one per test case):
``pass``; ``fail``, for a regression test only when it failed with its bug
signature; ``error``, anything that cannot tell (import or collection
error, harness error, API drift, timeout, a crash with another message);
``skip``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .core import PROJECT, UserError, say
from .warm import enabled as warm_enabled
from .warm import run_pytest

PLUGIN = Path(__file__).with_name("pytest_plugin.py")


@dataclasses.dataclass
class Outcome:
    """The verdict of one requested node id (one or more test cases)."""

    verdict: str  # pass | fail | error | skip
    reason: str = ""
    seconds: float = 0.0
    passed: int = 0
    skipped: int = 0  # skips other than for a device or tree the test is not for
    device_skipped: int = 0  # skips for a device or tree the test is not for
    asserted: int = 0  # cases whose own checks failed: what kills a mutant

    def to_json(self) -> dict:
        d: dict = {"verdict": self.verdict}
        if self.reason:
            d["reason"] = self.reason
        if self.skipped or self.device_skipped:
            d["skipped"] = self.skipped + self.device_skipped
        if self.seconds:
            d["seconds"] = round(self.seconds, 1)
        return d


RANK = {"error": 3, "fail": 2, "skip": 1, "pass": 0}


def aggregate(outcomes: list[Outcome]) -> Outcome:
    """One outcome for several: the worst verdict (error > fail > skip >
    pass) with its reason, counts and seconds summed. Skips for a device
    or tree the test is not for do not turn a pass into a skip; cases that
    all skipped are a skip."""
    if not outcomes:
        return Outcome("skip", "no test")
    worst = max(outcomes, key=lambda o: RANK[o.verdict])
    return Outcome(
        worst.verdict,
        worst.reason,
        sum(o.seconds for o in outcomes),
        sum(o.passed for o in outcomes),
        sum(o.skipped for o in outcomes),
        sum(o.device_skipped for o in outcomes),
        sum(o.asserted for o in outcomes),
    )


def test_python(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("VLLM_PATCHES_PYTHON"):
        return os.environ["VLLM_PATCHES_PYTHON"]
    venv = PROJECT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def tree_version(tree: Path) -> str:
    """The release version the tree says it is (vllm/_version.py)."""
    path = tree / "vllm" / "_version.py"
    text = path.read_text() if path.is_file() else ""
    m = re.search(r"^__version__ = version = ['\"]([^'\"]+)", text, re.MULTILINE)
    return m.group(1) if m else "0.0.0+tree"


def tree_env(tree: Path, scratch: Path) -> dict[str, str]:
    """Environment that makes `tree` the only vLLM of a run, with private
    caches under `scratch`.

    An uninstalled tree has no package metadata, and vLLM reads its own
    version from there (platform detection; from v0.23.0 also the Triton
    check, which otherwise turns Triton off): a minimal vllm-<version>
    dist-info beside the tree answers it as an installed vLLM would.
    """
    meta = scratch / "metadata"
    info = meta / f"vllm-{tree_version(tree)}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {tree_version(tree)}\n"
    )
    caches = scratch / "cache"
    paths = [str(tree), str(meta)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {
        "VLLM_TREE": str(tree),
        "PYTHONPATH": os.pathsep.join(paths),
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "XDG_CACHE_HOME": str(caches / "xdg"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_PATCHES_TREE_ENV": str(tree),
    }


def run_tests(
    root: Path,
    tree: Path,
    node_ids: list[str],
    python: str,
    label: str,
    extra_env: dict[str, str] | None = None,
    warm: bool = False,
) -> tuple[dict[str, Outcome], str]:
    """Run pytest on node ids against a tree; an Outcome per node id.
    `warm`: forked from this thread's warm interpreter (warm.py)."""
    if not node_ids:
        return {}, ""
    # a missing file would stop pytest before it runs anything: leave it out,
    # and its node ids come out as errors
    files = [
        f
        for f in dict.fromkeys(n.split("::", 1)[0] for n in node_ids)
        if (root / f).exists()
    ]
    with tempfile.TemporaryDirectory(prefix="vllm-patches-run-") as tmp:
        scratch = Path(tmp)
        xml = scratch / "junit.xml"
        plugins = scratch / "plugins"
        plugins.mkdir()
        shutil.copy(PLUGIN, plugins / "vllm_patches_plugin.py")
        env = dict(os.environ)
        env.update(tree_env(tree, scratch))
        env.update(extra_env or {})
        env["PYTHONPATH"] = os.pathsep.join([str(plugins), env["PYTHONPATH"]])
        env.update(
            PYTHONUNBUFFERED="1",
            VLLM_PATCHES_SELECT="\n".join(node_ids),
            VLLM_PATCHES_TEST_TIMEOUT=os.environ.get(
                "VLLM_PATCHES_TEST_TIMEOUT", "900"
            ),
        )
        cmd = [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "vllm_patches_plugin",
            f"--rootdir={root}",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={xml}",
            "--continue-on-collection-errors",
            *files,
        ]
        say(f"apply.py: pytest ({label}): {len(node_ids)} node id(s)")
        output, lost = pytest_run(cmd, root, env, warm)
        cases = parse_junit(xml) if xml.exists() else []
    if not cases and not lost:
        lines = [ln for ln in output.strip().splitlines() if ln.strip()]
        lost = "pytest reported nothing: " + (lines[-1] if lines else "no output")
    out = {}
    for nid in node_ids:
        mine = [c for c in cases if covers(nid, c[0])]
        if not mine:
            out[nid] = Outcome("error", lost or "not collected (no such test)")
        else:
            out[nid] = aggregate([o for _, o in mine])
    return out, output


def pytest_run(cmd: list[str], root: Path, env: dict, warm: bool) -> tuple[str, str]:
    """`cmd` (python -m pytest ...) in `root`, in a fresh interpreter or,
    with `warm`, forked from this thread's warm one: its output, and why
    its results are lost ("" when they are not)."""
    timeout = float(os.environ.get("VLLM_PATCHES_RUN_TIMEOUT", "5400"))
    try:
        if warm and warm_enabled():
            proc = run_pytest(cmd[0], cmd[3:], root, env, timeout)
        else:
            proc = subprocess.run(
                cmd,
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
    except subprocess.TimeoutExpired as e:
        lost = f"the pytest run timed out after {timeout:.0f} s"
        return f"{lost}\n{e.stdout or ''}", lost
    except OSError as e:
        raise UserError(f"cannot run the test Python '{cmd[0]}': {e}") from None
    return proc.stdout + proc.stderr, ""


def covers(requested: str, case: str) -> bool:
    if case == requested:
        return True
    if case.startswith((requested + "::", requested + "[")):
        return True
    # a collection error is reported against the module
    return "::" not in case and requested.split("::")[0] == case


def case_outcome(tc) -> Outcome:
    """The Outcome of one JUnit test case: the plugin's verdict property,
    else (a collection error, a run without the plugin) from the element."""
    props = {p.get("name"): p.get("value") for p in tc.iter("property")}
    secs = float(tc.get("time") or 0.0)
    verdict = props.get("verdict")
    if verdict is None:
        bad = tc.find("error")
        if bad is None:
            bad = tc.find("failure")
        if bad is not None:
            lines = (bad.text or "").splitlines()
            e_lines = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
            reason = (e_lines or [bad.get("message") or "error"])[-1]
            return Outcome("error", reason[:300], secs)
        verdict = "skip" if tc.find("skipped") is not None else "pass"
    o = Outcome(verdict, props.get("reason", ""), secs)
    o.asserted = int(verdict == "fail" or props.get("assertion") == "1")
    if verdict == "pass":
        o.passed = 1
    elif verdict == "skip" and props.get("skip") in ("device", "tree"):
        o.verdict, o.device_skipped = "pass", 1
    elif verdict == "skip":
        o.skipped = 1
    return o


def parse_junit(xml: Path) -> list[tuple[str, Outcome]]:
    """(node id, Outcome) per test case of a pytest xunit1 report."""
    import xml.etree.ElementTree as ET

    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        f, cls, name = (tc.get(k) or "" for k in ("file", "classname", "name"))
        if not cls:  # a collection error: the name is the module's dotted path
            cid = f or name.replace(".", "/") + ".py"
        else:
            module = f[:-3].replace("/", ".") if f.endswith(".py") else f
            klass = cls[len(module) + 1 :] if cls.startswith(module + ".") else ""
            cid = "::".join(x for x in (f, klass, name) if x)
        cases.append((cid, case_outcome(tc)))
    return cases
