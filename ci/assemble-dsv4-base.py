#!/usr/bin/env python3
"""Assemble the local verification base of the ``dsv4`` stack.

The ``dsv4`` patches fix code that never reached a vLLM release: it lives on
the branches of vllm PR 40889 / PR 40892 (ROCm DeepSeek-V4 AITER decode).
No single public commit is known to hold *both* pre-fix files, so each patch
is pinned to the commit of the one file it changes (see ``series``):

* ``dsv4/0001``: ``vllm/v1/attention/ops/rocm_aiter_dsv4_decode.py`` at
  vllm-project/vllm 3fccdd96d4db, a PR 40889 commit reachable from the pull
  refs (its ``AiterSparseScratch`` caches the AITER work plan by shape key).
  At a20791434ee0 the file already carries PR 40892's fix.
* ``dsv4/0002``: ``vllm/model_executor/layers/deepseek_compressor.py`` at
  ChuanLi1101/vllm a20791434ee0, in the fork of the PRs' author
  (``_forward_old`` rotates with the chunk's last position). The file at
  3fccdd96d4db is not known.

For the targeted tests we need one importable tree holding both: the vLLM
v0.20.0 release (Python sources of the PyPI wheel, which already carries the
DeepSeek-V4 model, compressor and ``deepseek_v4_ops``) with those two file
versions put in place. Neither file imports anything that v0.20.0 lacks.
The result is a git repository whose single commit is tagged ``base``; the
patches of the stack are committed on top of it.

This script holds no code of those repositories. It takes the two files
from either

* ``--from-git REPO``: a git repository where the pinned commits were
  fetched (it prints the ``git fetch`` commands when they are missing), or
* ``--fetched DIR``: a directory holding ``<owner>-<name>-<commit>/<path>``
  for each pinned file (e.g. saved by hand from the GitHub web UI).

Usage (stdlib only, Python >= 3.10)::

    python3 ci/assemble-dsv4-base.py --print-fetch   # the git fetch commands
    pip download --no-deps --only-binary=:all: vllm==0.20.0 -d /tmp/h6/dl
    python3 ci/assemble-dsv4-base.py --wheel /tmp/h6/dl/vllm-0.20.0-*.whl \\
        --fetched /tmp/h6/fetched /tmp/h6/vllm
    # or: ... --from-git ~/src/vllm /tmp/h6/vllm

Exit codes: 0 done, 2 bad input (one line on stderr says what to do).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEEL_NAME = "vllm-0.20.0-cp38-abi3-manylinux_2_35_x86_64.whl"
# sha256 of the file above as pip downloads it from PyPI.
WHEEL_SHA256 = "24d28892e210200f6e1bd13f699c42a74cd2bb7364c11248e2348f677c7f6dfb"

IDENT = "vllm-patch-series"
EMAIL = "vllm-patch-series@users.noreply.github.com"
DATE = "2026-11-21T12:00:00+00:00"


@dataclass(frozen=True)
class Pin:
    patch: str
    repo: str  # owner/name on GitHub
    branch: str
    commit: str
    path: str
    chars: int  # length of the file's text, a guard against a bad save
    # Git blob id the patch's "index" line names as its preimage.
    blob: str

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}"

    @property
    def slug(self) -> str:
        return f"{self.repo.replace('/', '-')}-{self.commit}"


PINS = (
    Pin(
        patch="dsv4/0001-rocm-aiter-sparse-scratch-refresh-metadata.patch",
        repo="vllm-project/vllm",
        branch="refs/pull/40889/head",
        commit="3fccdd96d4db06e31ad24274bca32661f65948ea",
        path="vllm/v1/attention/ops/rocm_aiter_dsv4_decode.py",
        chars=10075,
        blob="2e847a4191c981db262e78b5c1980d20be7593c6",
    ),
    Pin(
        patch="dsv4/0002-rocm-dsv4-compressor-first-token-rope.patch",
        repo="ChuanLi1101/vllm",
        branch="rocm/aiter-mla-dsv4-decode-cudagraph",
        commit="a20791434ee06cc619df33543becd8a838e4d431",
        path="vllm/model_executor/layers/deepseek_compressor.py",
        chars=25663,
        blob="a3afec4f5117ee55aa1081e7c72c6b588313051d",
    ),
)


def die(msg: str) -> None:
    print(f"assemble-dsv4-base: {msg}", file=sys.stderr)
    sys.exit(2)


def git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=env,
        check=True,
        text=True,
        capture_output=True,
    ).stdout


def fetch_commands(pins: tuple[Pin, ...] = PINS) -> list[str]:
    return [f"git fetch {p.url} {p.commit}" for p in pins]


def read_pinned(pin: Pin, fetched: Path | None, repo: Path | None) -> bytes:
    if repo is not None:
        try:
            git("cat-file", "-e", f"{pin.commit}^{{commit}}", cwd=repo)
        except subprocess.CalledProcessError:
            die(
                f"{pin.commit} is not in {repo}; run there: "
                f"git fetch {pin.url} {pin.commit}"
            )
        return subprocess.run(
            ["git", "show", f"{pin.commit}:{pin.path}"],
            cwd=repo,
            check=True,
            capture_output=True,
        ).stdout
    assert fetched is not None
    src = fetched / pin.slug / pin.path
    if not src.is_file():
        die(f"missing {src}: save {pin.url}/blob/{pin.commit}/{pin.path} there")
    return src.read_bytes()


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def extract_wheel(wheel: Path, out: Path) -> None:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        die(f"{wheel}: sha256 {digest} is not that of {WHEEL_NAME}")
    with zipfile.ZipFile(wheel) as zf:
        # Same as: unzip -q WHEEL 'vllm/*' -x '*.so' -d OUT
        members = [
            m
            for m in zf.namelist()
            if m.startswith("vllm/") and not m.endswith(".so") and not m.endswith("/")
        ]
        zf.extractall(out, members)


def commit_base(out: Path) -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_DATE=DATE,
        GIT_COMMITTER_DATE=DATE,
        GIT_AUTHOR_NAME=IDENT,
        GIT_AUTHOR_EMAIL=EMAIL,
        GIT_COMMITTER_NAME=IDENT,
        GIT_COMMITTER_EMAIL=EMAIL,
    )
    git("init", "-q", "-b", "main", cwd=out)
    # Tests import from this tree; keep their bytecode out of `git status`.
    (out / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
    git("add", "-A", ".", cwd=out)
    lines = [
        "dsv4 base: vLLM v0.20.0 wheel sources + pinned pre-fix files",
        "",
        f"vLLM {WHEEL_NAME} (sha256 {WHEEL_SHA256}), Python sources only,",
        "with these files replaced by their versions at the pinned commits:",
        "",
    ]
    lines += [f"  {p.path}\n    {p.url} {p.commit}" for p in PINS]
    git(
        "-c",
        "commit.gpgsign=false",
        "commit",
        "-q",
        "-m",
        "\n".join(lines),
        cwd=out,
        env=env,
    )
    git("tag", "-f", "base", cwd=out)
    return git("rev-parse", "HEAD", cwd=out).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "out", type=Path, nargs="?", help="directory to create (the base tree)"
    )
    ap.add_argument("--wheel", type=Path, required=False, help=f"path to {WHEEL_NAME}")
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--fetched", type=Path, help="directory of <owner>-<name>-<commit>/<path> files"
    )
    src.add_argument(
        "--from-git",
        type=Path,
        dest="repo",
        help="git repository holding the pinned commits",
    )
    ap.add_argument(
        "--print-fetch",
        action="store_true",
        help="print the git fetch commands for the pins and exit",
    )
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args(argv)

    if args.print_fetch:
        print("\n".join(fetch_commands()))
        return 0
    if args.out is None:
        die("give the directory to create the base tree in")
    if args.wheel is None or not args.wheel.is_file():
        die(
            f"--wheel: give {WHEEL_NAME} (pip download --no-deps "
            "--only-binary=:all: vllm==0.20.0 -d DIR)"
        )
    if args.fetched is None and args.repo is None:
        die("give --fetched DIR or --from-git REPO for the pinned files")
    if args.out.exists():
        if not args.force:
            die(f"{args.out} exists; remove it or pass --force")
        shutil.rmtree(args.out)

    contents = {p.path: read_pinned(p, args.fetched, args.repo) for p in PINS}
    for pin in PINS:
        n = len(contents[pin.path].decode("utf-8"))
        if n != pin.chars:
            die(
                f"{pin.path}: {n} characters, expected {pin.chars} at "
                f"{pin.repo}@{pin.commit}"
            )

        if blob_id(contents[pin.path]) != pin.blob:
            # Not fatal: the patches were made against this blob; a different
            # one means they may need `git am -3` (and a re-export).
            print(
                f"assemble-dsv4-base: warning: {pin.path} is blob "
                f"{blob_id(contents[pin.path])}, the patch expects {pin.blob}",
                file=sys.stderr,
            )

    args.out.mkdir(parents=True)
    extract_wheel(args.wheel, args.out)
    for path, data in contents.items():
        (args.out / path).parent.mkdir(parents=True, exist_ok=True)
        (args.out / path).write_bytes(data)
    head = commit_base(args.out)
    print(f"{args.out}: base = {head}")
    for pin in PINS:
        print(f"  {pin.path} <- {pin.repo}@{pin.commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
