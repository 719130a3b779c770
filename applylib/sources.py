"""vLLM's Python sources as git commits: the files of a wheel or of an
installed vllm package (all of vllm/ but compiled extensions and
bytecode), committed by git fast-import as one root commit with a fixed
identity and date, so the same files give the same commit id everywhere."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import zlib
from pathlib import Path

from .core import BASE_DATE, IDENTITY, TOOL_NAME, UserError, failed, git, gout

COMPILED = re.compile(r"\.so(\.\d+)*$")
File = tuple[str, str, bytes]  # path, mode, data


def wheel_files(wheel: Path) -> list[File]:
    """Every file under vllm/ of a wheel but compiled extensions."""
    import zipfile

    out = []
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                n = info.filename
                if not n.startswith("vllm/") or n.endswith("/") or COMPILED.search(n):
                    continue
                x = (info.external_attr >> 16) & 0o111
                out.append((n, "100755" if x else "100644", zf.read(n)))
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise UserError(
            f"{wheel}: not a whole wheel ({e}): delete it or download it again"
        ) from None
    if not out:
        raise UserError(f"{wheel}: no vllm/ sources inside")
    return out


def installed_files(package: Path) -> list[File]:
    """Every file of an installed vllm package but compiled extensions and
    bytecode, as paths under vllm/."""
    out = []
    for f in sorted(package.rglob("*")):
        rel = f.relative_to(package).as_posix()
        if "__pycache__" in rel.split("/") or not f.is_file() or f.is_symlink():
            continue
        if COMPILED.search(rel) or rel.endswith(".pyc"):
            continue
        x = f.stat().st_mode & 0o111
        out.append((f"vllm/{rel}", "100755" if x else "100644", f.read_bytes()))
    return out


def version_commit(files: list[File]) -> str | None:
    """The upstream commit vllm/_version.py names (__commit_id__)."""
    for path, _, data in files:
        if path == "vllm/_version.py":
            m = re.search(rb"__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'", data)
            return m.group(1).decode() if m else None
    return None


def import_files(repo: Path, files: list[File], msg: str) -> str:
    """One root commit of `files`, with fixed author, committer and date:
    the same files and message give the same commit id everywhere."""
    data = msg.encode()
    ref = f"refs/{TOOL_NAME}/import-{os.getpid()}"  # runs side by side
    ident = f"{IDENTITY[0]} <{IDENTITY[1]}> {BASE_DATE}"
    with tempfile.TemporaryFile() as stream:
        stream.write(
            f"commit {ref}\nauthor {ident}\ncommitter {ident}\n"
            f"data {len(data)}\n".encode()
            + data
            + b"deleteall\n"
        )
        for path, mode, body in files:
            stream.write(f"M {mode} inline {path}\ndata {len(body)}\n".encode())
            stream.write(body + b"\n")
        stream.write(b"\n")
        stream.seek(0)
        fi = subprocess.run(
            ["git", "fast-import", "--quiet", "--force"],
            cwd=repo,
            stdin=stream,
            capture_output=True,
            check=False,
        )
    if fi.returncode != 0:
        failed("git fast-import", fi.returncode, fi.stderr)
        err = fi.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(f"git fast-import failed: {err[-1] if err else '?'}")
    c = gout("rev-parse", ref, cwd=repo)
    git("update-ref", "-d", ref, cwd=repo)
    return c
