"""A release's own tests: the tests/ folder of its source distribution.

Release wheels carry vLLM's package only; its tests ship in the sdist
(vllm-X.Y.Z.tar.gz). pip cannot download an sdist without building its
metadata (vLLM's needs a CUDA build setup), so the archive is found the
way pip finds it, on the package index's simple page (pip's configured
index, extra indexes and find-links folders) and checked against the
page's sha256, then kept in the tool's cache with its tests/ extracted.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from .bases import BaseUnavailable, cache_dir
from .core import say

HREF = re.compile(r'href="([^"]+)"', re.IGNORECASE)


def pip_settings() -> dict[str, list[str]]:
    """index-url, extra-index-url, find-links and no-index as pip reads
    them: its environment variables over its configuration files."""
    got: dict[str, list[str]] = {}
    p = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in p.stdout.splitlines():
        m = re.match(r"^[\w:.-]*?\.?([\w-]+)='(.*)'$", line)
        if m:
            got[m.group(1)] = m.group(2).split()
    for key in ("index-url", "extra-index-url", "find-links", "no-index"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env is not None:
            got[key] = env.split()
    return got


def sdist_sources(version: str) -> list[str]:
    """Where the sdist may be: each find-links folder (or page), then each
    index's page for vllm."""
    from pip._internal.models.index import PyPI  # pip's default index

    s = pip_settings()
    no_index = (s.get("no-index") or ["0"])[0].lower() in ("1", "true", "yes")
    pages = [] if no_index else s.get("index-url", [PyPI.simple_url])
    pages = pages + ([] if no_index else s.get("extra-index-url", []))
    return s.get("find-links", []) + [u.rstrip("/") + "/vllm/" for u in pages]


def find_sdist(version: str) -> tuple[str, str | None] | None:
    """(URL or path, sha256 or None) of vllm-VERSION.tar.gz, or None."""
    name = f"vllm-{version}.tar.gz"
    for src in sdist_sources(version):
        local = Path(src.removeprefix("file://"))
        if "://" not in src or src.startswith("file://"):
            if local.is_dir() and (local / name).is_file():
                return str(local / name), None
            page = local / "index.html" if local.is_dir() else local
            if not page.is_file():
                continue
            text = page.read_text(errors="replace")
            src = page.as_uri()
        else:
            try:
                with urllib.request.urlopen(src, timeout=60) as r:
                    text = r.read().decode(errors="replace")
            except OSError:
                continue
        for href in HREF.findall(text):
            url, _, frag = href.partition("#")
            if url.rsplit("/", 1)[-1] == name:
                sha = frag[7:] if frag.startswith("sha256=") else None
                return urllib.parse.urljoin(src, url), sha
    return None


def release_tests(version: str) -> Path:
    """The tests/ folder of release VERSION's sdist, from the cache or
    downloaded once (about 50 MB)."""
    root = cache_dir() / "sdist" / f"vllm-{version}"
    if (root / "tests").is_dir():
        return root / "tests"
    found = find_sdist(version)
    if found is None:
        raise BaseUnavailable(
            f"vllm {version}'s source distribution is not on the package index",
            f"give --repo a vLLM clone at v{version} (its tests/ are used)",
        )
    src, sha = found
    say(f"apply.py: the vllm {version} sdist for its tests/: {src.split('#')[0]}")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        if "://" in src and not src.startswith("file://"):
            with urllib.request.urlopen(src, timeout=120) as r, archive.open("wb") as f:
                shutil.copyfileobj(r, f)
        else:
            shutil.copyfile(src.removeprefix("file://"), archive)
        if sha and hashlib.sha256(archive.read_bytes()).hexdigest() != sha:
            raise BaseUnavailable(f"{src}: sha256 differs from the index's", src)
        extract_tests(archive, Path(tmp) / "out")
        os.replace(Path(tmp) / "out", root)
    return root / "tests"


def extract_tests(archive: Path, dest: Path) -> None:
    """The archive's <top>/tests/ files, as dest/tests/ (regular files only)."""
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 3 or parts[1] != "tests" or not m.isfile():
                continue
            if ".." in parts or Path(m.name).is_absolute():
                continue
            target = dest.joinpath(*parts[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as f:  # type: ignore[union-attr]
                target.write_bytes(f.read())
