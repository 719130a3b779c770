"""Harness for the targeted tests of the patches.

The tests import vLLM from a source tree, never from an installed package:
``VLLM_TREE`` names the tree's root (the directory holding ``vllm/``), and it
is put first on ``sys.path`` before anything imports vLLM. ``apply.py`` sets
it for each tree it tests (the unpatched base and the patched tree); by hand:

    VLLM_TREE=/path/to/vllm-checkout .venv/bin/python -m pytest tests/patches

Without ``VLLM_TREE`` every test here is skipped, with that reason, but for
those marked ``no_tree`` (they test our own fakes, not vLLM).

What a source tree on a CPU-only machine needs, done here openly rather than
by editing the tree under test:

* vLLM turns Triton off when no GPU driver is present unless
  ``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` are set; with them
  the TurboQuant Triton kernels run in Triton's interpreter on CPU tensors.
  Both are set (unless already set) when torch sees no CUDA device.
  Under the interpreter ``tqharness.faster_interpreter`` drops its repeated
  patching of ``triton.language`` at every jit'd helper call, and
  ``tqharness.exact_fp8_casts`` makes its fp8 casts round as a GPU's do.
* The tree must be the only vLLM every process sees, subprocesses
  included (vLLM inspects model classes in a subprocess), with caches of
  the run's own: apply.py gives each run that environment
  (``applylib/testrun.py``: the tree and a minimal package metadata for it
  lead ``PYTHONPATH``; private vLLM, Triton and torch.compile caches). Run
  by hand, this conftest sets up the same environment.
* Platform detection still finds no platform on a CPU-only machine: the
  ``cpu_platform`` fixture installs vLLM's ``CpuPlatform`` for tests that
  need one.
* Generated (hypothesis) tests draw the same examples everywhere: a fixed
  seed per test, no example database (the ``vllm-patches`` profile below),
  and at most ``SHRINK_SECONDS`` of shrinking a failure.
* ``WorkspaceManager`` calls ``torch.accelerator.empty_cache()`` when it
  grows, which raises on a CPU-only torch: the autouse fixture
  ``_accelerator_empty_cache_noop`` makes it a no-op when no accelerator
  exists.

Test modules import vLLM inside tests or fixtures (not at module level), so
that collection works without a tree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis.internal.conjecture import engine

HAS_CUDA = torch.cuda.is_available()
TREE = os.environ.get("VLLM_TREE", "")

# Generated tests draw the same examples on every machine and run (a seed
# from each test's source), with no example database: a verdict must not
# depend on the machine or on what an earlier run happened to find. A
# test's own @settings refine this profile.
settings.register_profile("vllm-patches", derandomize=True, database=None)
settings.load_profile("vllm-patches")
# A failing generated test stops shrinking after this long (hypothesis'
# own cap, 300 s, has no setting): what a verdict on a base tree costs at
# most, the failure reported the smallest found by then.
SHRINK_SECONDS = 60
engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS

if not HAS_CUDA:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import tqharness

    tqharness.faster_interpreter()
    tqharness.exact_fp8_casts()

if TREE and not os.environ.get("VLLM_PATCHES_TREE_ENV"):
    # Run by hand: the environment apply.py gives every run.
    import tqharness

    _tree = Path(TREE).resolve()
    if not (_tree / "vllm" / "__init__.py").is_file():
        raise pytest.UsageError(f"VLLM_TREE={TREE}: no vllm/__init__.py there")
    tqharness.use_tree_env(_tree)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped elsewhere")
    config.addinivalue_line("markers", "cpu_only: CPU by design; skipped on a GPU")
    config.addinivalue_line(
        "markers",
        "bug_signature(exc, pattern): how the bug shows; apply.py counts a "
        "failure of a regression test as the bug only with it",
    )
    config.addinivalue_line(
        "markers", "no_tree: needs no vLLM tree; runs without VLLM_TREE too"
    )
    config.addinivalue_line(
        "markers",
        "some_trees: compares what only some vLLM trees have; its skip "
        "elsewhere is not a missing verdict",
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    here = Path(__file__).parent
    no_tree = pytest.mark.skip(reason="VLLM_TREE is not set (see conftest.py)")
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    on_gpu = pytest.mark.skip(reason="CPU by design")
    for item in items:
        if here not in Path(item.fspath).parents:
            continue
        if not TREE and "no_tree" not in item.keywords:
            item.add_marker(no_tree)
        elif "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)
        elif "cpu_only" in item.keywords and HAS_CUDA:
            item.add_marker(on_gpu)


@pytest.fixture(scope="session")
def vllm_tree() -> Path:
    """The tree under test; asserts that ``import vllm`` resolves into it."""
    import vllm

    tree = Path(TREE).resolve()
    got = Path(vllm.__file__).resolve()
    assert tree in got.parents, f"vllm imported from {got}, not from {tree}"
    return tree


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _accelerator_empty_cache_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.accelerator.current_accelerator() is None:
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)


@pytest.fixture
def cpu_platform(vllm_tree: Path, monkeypatch: pytest.MonkeyPatch):
    """Install vLLM's platform for the tree as ``current_platform``
    (``tqharness.install_platform``): CpuPlatform, also on a GPU when the
    tree is a plain source tree (CudaPlatform needs vLLM's compiled
    extensions, which it lacks; the tensors and Triton kernels still run on
    the GPU). A built tree (``vllm/_C*.so`` present) gets CudaPlatform."""
    import tqharness

    return tqharness.install_platform(vllm_tree, monkeypatch.setattr)


@pytest.fixture
def gd(cpu_platform: Any) -> Any:
    """The grouped decode module (tq-v0.33), imported under the tree's
    platform (on a GPU a plain source tree has no CUDA platform to import it
    under)."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    return gd
