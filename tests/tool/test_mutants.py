"""apply.py mutants on the fixture stack: a stack's name picks all its
patches with mutants; a killed mutant passes, a surviving one fails."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import APPLY, FIXED_ADD, FIXED_BOTH, Fixture, standard_stack


def add_mutant(fx: Fixture, patch: str, name: str, tree: str, mutated: str) -> None:
    """tests/mutants/fx/<patch>/<name>.diff: vllm/mod.py from `tree` (the
    file as the patch leaves it) to `mutated`."""
    folder = fx.project / "tests" / "mutants" / "fx" / patch
    folder.mkdir(parents=True, exist_ok=True)
    diff = "".join(difflib.unified_diff(
        tree.splitlines(True), mutated.splitlines(True),
        "a/vllm/mod.py", "b/vllm/mod.py"))
    (folder / f"{name}.diff").write_text(
        f"Mutant: {name}\n\ndiff --git a/vllm/mod.py b/vllm/mod.py\n{diff}")


def mutants(
    fx: Fixture, *words: str, jobs: int = 1
) -> tuple[subprocess.CompletedProcess, list]:
    out = fx.tmp / "mutants.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, VLLM_PATCHES_CACHE=str(fx.cache),
               VLLM_PATCHES_OFFLINE="1", VLLM_PATCHES_JOBS=str(jobs))
    p = subprocess.run(
        [sys.executable, str(APPLY), "mutants", *words, "--series",
         str(fx.series), "--repo", str(fx.upstream), "--python", sys.executable,
         "--json", str(out)],
        cwd=fx.project, env=env, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["mutants"] if out.exists() else []
    return p, rows


def test_mutants_of_a_stack_by_its_name(fx: Fixture) -> None:
    standard_stack(fx)
    add_mutant(fx, "0001-fix-add", "subtraction-back", FIXED_ADD,
               FIXED_ADD.replace("return a + b", "return a - b"))
    add_mutant(fx, "0002-fix-scale", "scale-doubled", FIXED_BOTH,
               FIXED_BOTH.replace("return x * 1", "return x * 2"))
    p, rows = mutants(fx, "fx")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted((Path(r["patch"]).name, r["outcome"]) for r in rows) == [
        ("0001-fix-add.patch", "killed"), ("0002-fix-scale.patch", "killed")]
    p, rows = mutants(fx, "fx/0002")
    assert p.returncode == 0 and [r["patch"] for r in rows] == [
        "fx/0002-fix-scale.patch"], p.stdout + p.stderr
    # a mutant no test notices (same behaviour, other text) survives
    add_mutant(fx, "0001-fix-add", "same-sum", FIXED_ADD,
               FIXED_ADD.replace("return a + b", "return b + a"))
    p, rows = mutants(fx, "fx")
    assert p.returncode == 1, p.stdout + p.stderr
    assert {r["outcome"] for r in rows if "same-sum" in json.dumps(r)} != {"killed"}


def test_mutants_side_by_side_each_run_stops_at_its_kill(fx: Fixture) -> None:
    """Mutants of both patches in two lanes: each is judged on its own tree
    (0002's on the tree with 0001), and a run stops at its first kill: the
    patch's later tests do not run."""
    standard_stack(fx)
    after = fx.tmp / "after-kill"
    with open(fx.project / "tests" / "patches" / "test_add.py", "a") as f:
        f.write(f"\n\ndef test_after_kill():\n    open({str(after)!r}, 'a')\n")
    for k in range(1, 4):
        add_mutant(fx, "0001-fix-add", f"off-by-{k}", FIXED_ADD,
                   FIXED_ADD.replace("return a + b", f"return a + b + {k}"))
    add_mutant(fx, "0002-fix-scale", "scale-doubled", FIXED_BOTH,
               FIXED_BOTH.replace("return x * 1", "return x * 2"))
    p, rows = mutants(fx, "fx", jobs=2)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(r["mutant"], r["outcome"]) for r in rows] == [
        ("off-by-1", "killed"), ("off-by-2", "killed"), ("off-by-3", "killed"),
        ("scale-doubled", "killed")]
    assert not after.exists()
    trees = sorted(d.name for d in fx.cache.glob("worktrees/*/fx-at-*"))
    assert set(trees) <= {"fx-at-0", "fx-at-1", "fx-at-2", "fx-at-3"}
