"""Pinned files: the files a stack's patches change, as they are at their
pins, for a base assembled offline.

A stack whose base cannot be fetched (a pull-request branch, GitHub out of
reach) may name a release to assemble it from (``assemble=vX.Y.Z`` on its
``#@ stack`` line). Its base is then that release's tree with every file the
patches change put in place as it is at its pin (the patch's ``#@ pin``, else
the stack's own), read from a directory of fetched files,
``DIR/<owner>-<name>-<commit>/<path>`` (``--fetched DIR`` or
``$VLLM_PATCHES_FETCHED``). Each file must be, byte for byte, the blob the
patch was made on: the ``index <old>..`` line of its diff names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlparse

from .core import UPSTREAM_URL, UserError
from .series import DIFF_GIT, Stack, check_safe_relpath

INDEX_LINE = re.compile(rb"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: ([0-7]{6}))?$", re.M)


@dataclasses.dataclass(frozen=True)
class PinnedFile:
    path: str  # in the vLLM tree
    blob: str  # the git blob id the patch was made on (its index line)
    mode: str
    patch: str  # the first patch of the stack that changes it
    repo: str  # the pin: repository URL and commit
    commit: str

    def source(self, fetched: Path) -> Path:
        return fetched / f"{repo_slug(self.repo)}-{self.commit}" / self.path


def repo_slug(url: str) -> str:
    """owner-name of a repository URL (https://github.com/owner/name[.git])."""
    path = urlparse(url).path if "://" in url else url.rsplit(":", 1)[-1]
    parts = [p for p in path.removesuffix(".git").split("/") if p]
    return "-".join(parts[-2:]) or "repo"


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fetched_dir(args: argparse.Namespace) -> Path | None:
    """--fetched DIR, else $VLLM_PATCHES_FETCHED; None when neither is set."""
    given = getattr(args, "fetched", None)
    raw = given or os.environ.get("VLLM_PATCHES_FETCHED") or None
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_dir():
        what = "--fetched" if given else "$VLLM_PATCHES_FETCHED"
        raise UserError(
            f"{what} {raw}: no such directory (give a directory of pinned "
            "files, DIR/<owner>-<name>-<commit>/<path>)"
        )
    return path.resolve()


def preimages(entry: str, raw: bytes) -> list[tuple[str, str, str | None]]:
    """(path, preimage blob id, mode) of each file a patch changes."""
    out = []
    for block in re.split(rb"(?m)^(?=diff --git )", raw):
        m = DIFF_GIT.match(block)
        if not m:
            continue
        path = m.group(1).decode()
        check_safe_relpath(path, f"patches/{entry}: touches")
        idx = INDEX_LINE.search(block.split(b"\n@@", 1)[0])
        if not idx or len(idx.group(1)) != 40:
            raise UserError(
                f"patches/{entry}: no full 'index' line for {path}: the "
                "preimage blob is unknown (re-export with apply.py format-patch)"
            )
        mode = idx.group(3).decode() if idx.group(3) else None
        out.append((path, idx.group(1).decode(), mode))
    return out


def pinned_files(stack: Stack) -> list[PinnedFile]:
    """The files the stack's base must hold as they are at their pins: each
    file the patches change, at the first patch that changes it (a file a
    patch creates has none)."""
    assert stack.patches_dir is not None
    seen: set[str] = set()
    out = []
    for entry in stack.patches:
        pin = stack.file_pins.get(entry, stack.pins)
        raw = (stack.patches_dir / entry).read_bytes()
        for path, blob, mode in preimages(entry, raw):
            if path in seen:
                continue
            seen.add(path)
            if set(blob) != {"0"}:
                repo = pin.get("repo", UPSTREAM_URL)
                out.append(
                    PinnedFile(path, blob, mode or "100644", entry, repo, pin["commit"])
                )
    return out


def read_pinned(f: PinnedFile, fetched: Path) -> bytes:
    """The file's bytes from the fetched directory, checked against the blob
    the patch was made on."""
    src = f.source(fetched)
    if not src.is_file():
        raise UserError(
            f"pinned file {src} is missing: {f.path} as it is at {f.repo} "
            f"{f.commit} (blob {f.blob}, the preimage of patches/{f.patch}); "
            f"from a clone holding that commit: git show {f.commit}:{f.path}"
        )
    data = src.read_bytes()
    if blob_id(data) != f.blob:
        raise UserError(
            f"pinned file {src} is blob {blob_id(data)}, but patches/{f.patch} "
            f"was made on blob {f.blob} ({f.path} at {f.repo} {f.commit})"
        )
    return data
