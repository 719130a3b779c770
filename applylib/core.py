"""Constants, errors and git plumbing shared by every part of apply.py."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent  # the project root


TOOL_NAME = "vllm-patches"


IDENTITY = ("vllm-patch-series", "vllm-patch-series@users.noreply.github.com")


REF_NS = "refs/heads/patched"


UPSTREAM_URL = "https://github.com/vllm-project/vllm"


# A fixed date for the commits the tool makes from release archives, so that
# the same release always gives the same commit id on every machine.
BASE_DATE = "946684800 +0000"  # 2000-01-01T00:00:00Z


UPSTREAM_STATUS = re.compile(
    r"^(Pending|Submitted \[\S+\]|Backport \[[^\]]+\]|Inappropriate \[[^\]]+\])$"
)


SPDX = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)


ZERO_FROM = b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"


# What the series accepts: the '#@' directives and the keys of each. The
# spec, docs/series-format.md, lists the same (ci/docs_check.py compares).
STACK_KEYS = {
    "repo",
    "tag",
    "branch",
    "commit",
    "upstream",
    "fetch",
    "assemble",
}


PIN_KEYS = {"repo", "branch", "commit", "fetch"}  # '#@ pin PATCH key=value ...'


RECORDS = ("not-needed", "dropped")  # patch records kept in series for history


RECORD_KEYS = {"base", "reason"}  # '#@ not-needed PATCH base=REV reason=...'


DIRECTIVES = ("stack", "pin", *RECORDS)


# The trailers 'apply.py check' reads in a patch's message: the required ones
# (each at least once) and those checked when present. Others are allowed.
REQUIRED_TRAILERS = ("Bug", "Upstream-Status", "Tests", "Signed-off-by")
URL_TRAILERS = ("Related", "Upstream-Target")  # each starts with a URL


# Deterministic export: every flag and config value that shapes format-patch
# output is pinned, so re-exporting an unchanged commit gives the same bytes.
FORMAT_PATCH_CONFIG = (
    "core.abbrev=12",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.renames=false",
    "diff.algorithm=myers",
    "diff.indentHeuristic=true",
    "format.signature=",
    "format.headers=",
    "format.numbered=false",
    "format.coverLetter=false",
    "format.signOff=false",
    "format.thread=false",
)


FORMAT_PATCH_FLAGS = (
    "format-patch",
    "--stdout",
    "--zero-commit",
    "--full-index",
    "--no-signature",
    "--keep-subject",
    "--no-renames",
    "--no-numbered",
    "--stat=72",
    "--encode-email-headers",
    "--no-attach",
    "--no-thread",
    "--no-to",
    "--no-cc",
)


# What git am must not take from the user's configuration.
AM_CONFIG = (
    "core.hooksPath=/dev/null",
    "am.keepcr=false",
    "am.threeWay=false",
    "am.messageid=false",
    "apply.whitespace=nowarn",
    "core.autocrlf=false",
    "commit.gpgSign=false",
    f"user.name={IDENTITY[0]}",
    f"user.email={IDENTITY[1]}",
)


class UserError(Exception):
    """Bad input or environment: exit 2 with one line on stderr."""


# what git and pip print when a disk or a quota is full or read-only: an
# environment fault, never a patch's conflict or a base's absence
DISK_FULL = (
    "No space left on device",
    "Disk quota exceeded",
    "Out of diskspace",
    "Read-only file system",
    "[Errno 28]",
    "[Errno 122]",
    "[Errno 30]",
)


# where this run writes (the cache, the user's repository, the build folder,
# --json): a failed git or pip that leaves one of them nearly full was the
# disk's fault, whatever it printed
PLACES: dict[Path, str] = {}
NEARLY_FULL = 2 * 2**20  # bytes


def writes_to(path: Path, what: str) -> None:
    """Record `path` (`what`: the cache, the repository ...) as written by
    this run, for disk_full to name when it fills up."""
    PLACES.setdefault(path, what)


def free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def room(path: Path, need_mb: int, what: str, hint: str) -> None:
    """Refuse to start on a read-only filesystem or one with less than
    `need_mb` MB free (0: no check)."""
    writes_to(path, what)
    if need_mb <= 0:
        return
    with contextlib.suppress(OSError):
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            raise UserError(f"{what} {path} is on a read-only file system")
    free = free_bytes(path)
    if free is not None and free // 2**20 < need_mb:
        raise UserError(
            f"{what} {path} has {free // 2**20} MB free, the run needs about "
            f"{need_mb} MB there: {hint}"
        )


# git commands that write nothing: their failures are answers, not faults
READS = {"rev-parse", "cat-file", "describe", "log", "show", "ls-files", "diff",
         "ls-tree", "for-each-ref", "merge-base", "rev-list", "format-patch",
         "config", "symbolic-ref", "status"}  # fmt: skip


def disk_full(what: str, output: str) -> None:
    """Raise UserError when `what` failed for want of room: `output` says
    a disk is full or read-only, or (a command that writes) a place the run
    writes is nearly full. Every failure of a git or pip is put through
    this before any fallback."""
    said = [line.strip() for line in output.splitlines()]
    said = [line for line in said if any(m in line for m in DISK_FULL)]
    full = {}
    writes = what.split()[-1] not in READS if what.startswith("git ") else True
    for path, name in PLACES.items() if writes else ():
        free = free_bytes(path)
        if free is not None and free < NEARLY_FULL:
            full[path] = (name, free)
    if not said and not full:
        return
    if full:
        path, (name, free) = min(full.items(), key=lambda kv: kv[1][1])
        where = f"{name} {path} has {free // 1024} KB free"
    else:
        where = "a disk is full or read-only"
    why = f" ({said[0]})" if said else ""
    raise UserError(
        f"{what} failed: {where}{why}: free space there (or set "
        "VLLM_PATCHES_CACHE to a disk with room) and run again"
    )


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def child_output(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A child process whose output (stdout and stderr, as text) the block
    reads; a child still running when the block is left (an interrupt, an
    error) is terminated, then killed after 10 s, so none outlives the run."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
    )
    try:
        yield proc
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def atomic_write(path: Path, data: bytes) -> None:
    """Write a file whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def git(
    *args: str,
    cwd: Path | str | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: bytes | None = None,
    config: tuple[str, ...] = (),
    timeout: float | None = None,
) -> subprocess.CompletedProcess[bytes]:
    cmd = ["git"]
    for c in config:
        cmd += ["-c", c]
    cmd += list(args)
    full_env = dict(os.environ)
    full_env.update({"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"})
    if env:
        full_env.update(env)
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        input=input,
        capture_output=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        failed(f"git {args[0]}", proc.returncode, proc.stderr)
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise GitError(
            f"git {' '.join(args[:4])}", proc.returncode, err[-1] if err else ""
        )
    return proc


def failed(what: str, rc: int, output: bytes | str) -> None:
    """Classify a failed git or pip before anything reads it as a verdict:
    killed by a signal, or short of disk (disk_full), is exit 2."""
    if rc == -signal.SIGINT:  # Ctrl-C reached it first: the run's interrupt
        raise KeyboardInterrupt
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else -rc
        raise UserError(f"{what} was killed ({name}): run again")
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    disk_full(what, output)


class GitError(Exception):
    def __init__(self, cmd: str, rc: int, last: str):
        super().__init__(f"{cmd}: exit {rc}: {last}")
        self.rc = rc


def gout(*args: str, cwd: Path | str | None = None, **kw) -> str:
    return git(*args, cwd=cwd, **kw).stdout.decode().strip()


def rev_commit(repo: Path, rev: str) -> str | None:
    proc = git(
        "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=repo, check=False
    )
    return proc.stdout.decode().strip() or None if proc.returncode == 0 else None


@functools.cache
def git_common_dir(repo: Path) -> Path:
    return Path(
        gout("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=repo)
    )


def open_repo(path: Path) -> Path:
    if not path.exists():
        raise UserError(f"{path}: no such directory (give a vLLM git repository)")
    proc = git("rev-parse", "--git-dir", cwd=path, check=False)
    if proc.returncode != 0:
        raise UserError(f"{path}: not a git repository (give a vLLM git clone)")
    return path.resolve()


def format_patch(repo: Path, rev: str) -> bytes:
    """The deterministic export of one commit."""
    return git(
        *FORMAT_PATCH_FLAGS, "-1", rev, cwd=repo, config=FORMAT_PATCH_CONFIG
    ).stdout


def command(
    sub: argparse._SubParsersAction,
    name: str,
    func: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """A command's parser: its one-line help, its description, its examples
    (printed as written) and the function that runs it."""
    sp = sub.add_parser(
        name,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help=help,
        description=description,
        epilog=epilog,
    )
    sp.set_defaults(func=func)
    return sp


def common(
    sp: argparse.ArgumentParser, *names: str, helps: dict[str, str] | None = None
) -> None:
    """The global options, accepted after a command too (default: not given).

    `helps` words an option's help for this command where it differs.
    """
    words = {
        "series": "series file",
        "base": "base revision (default: the stack's pin)",
        "repo": "vLLM git repository",
        "stack": "stack name",
        "python": "Python that runs the tests",
        "offline": "never try git remotes",
        "json": "write JSON here",
        "fetched": "directory of pinned files for offline bases "
        "(DIR/<owner>-<name>-<commit>/<path>; default $VLLM_PATCHES_FETCHED)",
    }
    words.update(helps or {})
    for n in names:
        if n == "offline":
            sp.add_argument(
                "--offline",
                action="store_true",
                default=argparse.SUPPRESS,
                help=words[n],
            )
        else:
            sp.add_argument(f"--{n}", default=argparse.SUPPRESS, help=words[n])


def patch_names(
    sp: argparse.ArgumentParser, help: str = "patch file names or prefixes"
) -> None:
    """The positional list of patches a command works on (default: all)."""
    sp.add_argument("patches", nargs="*", help=help)


def probe_writable(folder: Path) -> None:
    """Make `folder` and write a file there: OSError when it cannot be."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def writable_output(path: Path, flag: str) -> None:
    """Refuse an output path the run could not write, before the run."""
    target = path.expanduser().resolve()
    writes_to(target.parent, f"{flag}'s folder")
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "is a directory")
        probe_writable(target.parent)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None
