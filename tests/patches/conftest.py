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
* An uninstalled tree has no package metadata, and vLLM reads its own
  version from there (platform detection; from v0.23.0 also the Triton
  check, which otherwise turns Triton off): a minimal ``vllm-<version>``
  dist-info with the tree's version is put on ``sys.path`` after the tree.
* Platform detection still finds no platform on a CPU-only machine: the
  ``cpu_platform`` fixture installs vLLM's ``CpuPlatform`` for tests that
  need one.
* ``WorkspaceManager`` calls ``torch.accelerator.empty_cache()`` when it
  grows, which raises on a CPU-only torch: the autouse fixture
  ``_accelerator_empty_cache_noop`` makes it a no-op when no accelerator
  exists.

Test modules import vLLM inside tests or fixtures (not at module level), so
that collection works without a tree.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
TREE = os.environ.get("VLLM_TREE", "")

if not HAS_CUDA:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _tree_version(tree: Path) -> str:
    """The release version the tree says it is (vllm/_version.py)."""
    path = tree / "vllm" / "_version.py"
    text = path.read_text() if path.is_file() else ""
    m = re.search(r"^__version__ = version = ['\"]([^'\"]+)", text, re.M)
    return m.group(1) if m else "0.0.0+tree"


def _package_metadata_for(tree: Path) -> None:
    """Give the uninstalled tree the package metadata vLLM reads.

    vLLM asks importlib.metadata for its own version: platform detection
    does, and from v0.23.0 so does vllm/triton_utils/importing.py, which
    turns Triton off when the lookup fails. A minimal ``vllm-<version>``
    dist-info (name and version only), in a temporary directory put on
    sys.path after the tree, answers it as an installed vLLM would.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
        return  # an installed vLLM answers already (its files are shadowed)
    meta = Path(tempfile.mkdtemp(prefix="vllm-tree-metadata-"))
    atexit.register(shutil.rmtree, meta, True)
    info = meta / f"vllm-{_tree_version(tree)}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {_tree_version(tree)}\n"
    )
    sys.path.insert(1, str(meta))


if TREE:
    _tree = Path(TREE).resolve()
    if not (_tree / "vllm" / "__init__.py").is_file():
        raise pytest.UsageError(f"VLLM_TREE={TREE}: no vllm/__init__.py there")
    sys.path.insert(0, str(_tree))
    _package_metadata_for(_tree)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped elsewhere")
    config.addinivalue_line(
        "markers", "no_tree: needs no vLLM tree; runs without VLLM_TREE too"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    here = Path(__file__).parent
    no_tree = pytest.mark.skip(reason="VLLM_TREE is not set (see conftest.py)")
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if here not in Path(item.fspath).parents:
            continue
        if not TREE and "no_tree" not in item.keywords:
            item.add_marker(no_tree)
        elif "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)


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
    """Install vLLM's CpuPlatform as ``current_platform`` (an uninstalled
    tree detects none: detection reads the installed package's metadata).

    Also on a GPU when the tree is a plain source tree: CudaPlatform needs
    vLLM's compiled extensions (``vllm._C``, ``vllm.vllm_flash_attn``), which
    it lacks; the tensors and Triton kernels still run on the GPU. A built
    tree (``vllm/_C*.so`` present) gets CudaPlatform."""
    import vllm.platforms as platforms

    if HAS_CUDA and any((vllm_tree / "vllm").glob("_C.*so")):
        from vllm.platforms.cuda import CudaPlatform as Platform
    else:
        from vllm.platforms.cpu import CpuPlatform as Platform  # type: ignore

    plat = Platform()
    monkeypatch.setattr(platforms, "_current_platform", plat)
    return plat
