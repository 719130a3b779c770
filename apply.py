#!/usr/bin/env python3
"""apply.py: apply, verify and carry a series of vLLM patches.

The series file lists patches (git format-patch files under patches/) in
stacks, each pinned to a vLLM base. This tool applies a stack onto a base in a
worktree of its own, runs each patch's targeted tests against the patched tree
and its regression tests against the unpatched base, prints a table, writes a
JSON report and leaves the result as a branch in its own ref namespace
(refs/heads/patched/<stack>/<base>). It never changes the user's checkout.

Examples:
    python apply.py                          # every stack at its pinned base
    python apply.py --base v0.20.2 --repo ~/src/vllm --json report.json
    python apply.py check                    # lint the series (pre-commit)
    python apply.py test --tree ~/src/vllm   # targeted tests against a tree
    python apply.py base v0.21.0             # obtain a release base offline

Standard library and git only. Exit codes: 0 all good; 1 a patch conflicted
or a test failed; 2 bad input or environment (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath

PROJECT = Path(__file__).resolve().parent
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
STACK_KEYS = {"repo", "tag", "branch", "commit", "upstream", "pypi", "fetch"}
RECORDS = ("not-needed", "dropped")  # patch records kept in series for history

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


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# git


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
    )
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise GitError(" ".join(cmd[:6]), proc.returncode, err[-1] if err else "")
    return proc


class GitError(Exception):
    def __init__(self, cmd: str, rc: int, last: str):
        super().__init__(f"{cmd}: exit {rc}: {last}")
        self.rc = rc


def gout(*args: str, cwd: Path | str | None = None, **kw) -> str:
    return git(*args, cwd=cwd, **kw).stdout.decode().strip()


def rev_commit(repo: Path, rev: str) -> str | None:
    proc = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=repo,
               check=False)
    return proc.stdout.decode().strip() or None if proc.returncode == 0 else None


def git_common_dir(repo: Path) -> Path:
    return Path(gout("rev-parse", "--path-format=absolute", "--git-common-dir",
                     cwd=repo))


def open_repo(path: Path) -> Path:
    if not path.exists():
        raise UserError(f"{path}: no such directory (give a vLLM git repository)")
    proc = git("rev-parse", "--git-dir", cwd=path, check=False)
    if proc.returncode != 0:
        raise UserError(f"{path}: not a git repository (give a vLLM git clone)")
    return path.resolve()


def format_patch(repo: Path, rev: str) -> bytes:
    """The deterministic export of one commit."""
    return git(*FORMAT_PATCH_FLAGS, "-1", rev, cwd=repo,
               config=FORMAT_PATCH_CONFIG).stdout


# --------------------------------------------------------------------------
# series and patches


@dataclasses.dataclass
class Stack:
    name: str
    pins: dict[str, str]
    patches: list[str]
    lineno: int
    not_needed: list[dict[str, str]] = dataclasses.field(default_factory=list)
    patch_lines: dict[str, int] = dataclasses.field(default_factory=dict)

    file_pins: dict[str, dict[str, str]] = dataclasses.field(
        default_factory=dict)

    def fetch_hint(self, into: Path) -> str:
        """The git fetch command(s) that get the stack's base (and the
        per-patch pins' commits) into a repository."""
        cmds = []
        for pins in [self.pins, *self.file_pins.values()]:
            repo = pins.get("repo", UPSTREAM_URL)
            what = pins.get("fetch") or pins.get("commit") or pins.get("tag", "")
            cmd = f"git -C {into} fetch {repo} {what}"
            if cmd not in cmds:
                cmds.append(cmd)
        return " && ".join(cmds)


@dataclasses.dataclass
class Series:
    path: Path
    stacks: list[Stack]

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    def stack(self, name: str | None) -> Stack:
        if name is None:
            return self.stacks[0]
        for s in self.stacks:
            if s.name == name:
                return s
        names = ", ".join(s.name for s in self.stacks)
        raise UserError(f"unknown stack '{name}' (the series has: {names})")

    def digest(self, stack: Stack) -> str:
        h = hashlib.sha256()
        for p in stack.patches:
            h.update(p.encode() + b"\0" + (self.patches_dir / p).read_bytes())
        return h.hexdigest()


def parse_series(path: Path, need_patches: bool = True) -> Series:
    if not path.is_file():
        raise UserError(f"{path}: series file not found")
    stacks: list[Stack] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        where = f"{path.name}:{n}"
        if line.startswith("#@"):
            try:
                words = shlex.split(line[2:])
            except ValueError as e:
                raise UserError(f"{where}: malformed directive: {e}") from None
            if not words:
                raise UserError(f"{where}: empty '#@' directive")
            kind, rest = words[0], words[1:]
            kv: dict[str, str] = {}
            for w in rest[1:]:
                if "=" not in w:
                    raise UserError(f"{where}: malformed directive: expected "
                                    f"key=value, got '{w}'")
                k, v = w.split("=", 1)
                kv[k] = v
            if kind == "stack":
                if not rest or "=" in rest[0]:
                    raise UserError(f"{where}: malformed directive: "
                                    "'#@ stack NAME key=value ...'")
                name = rest[0]
                if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
                    raise UserError(f"{where}: bad stack name '{name}'")
                bad = set(kv) - STACK_KEYS
                if bad:
                    raise UserError(f"{where}: malformed directive: unknown key "
                                    f"'{sorted(bad)[0]}' (known: "
                                    f"{', '.join(sorted(STACK_KEYS))})")
                if not ({"commit", "tag", "branch"} & set(kv)):
                    raise UserError(f"{where}: stack '{name}' pins no base "
                                    "(give commit=, tag= or branch=)")
                if "commit" in kv and not re.fullmatch(r"[0-9a-f]{40}", kv["commit"]):
                    raise UserError(f"{where}: commit= must be 40 hex digits")
                if any(s.name == name for s in stacks):
                    raise UserError(f"{where}: stack '{name}' defined twice")
                stacks.append(Stack(name, kv, [], n))
            elif kind == "pin":
                if not stacks or not rest or "=" in rest[0] or \
                        set(kv) - {"repo", "branch", "commit", "fetch"}:
                    raise UserError(f"{where}: malformed directive: '#@ pin "
                                    "PATCH repo=URL commit=<40 hex> [branch=]'")
                if not re.fullmatch(r"[0-9a-f]{40}", kv.get("commit", "")):
                    raise UserError(f"{where}: commit= must be 40 hex digits")
                stacks[-1].file_pins[rest[0]] = kv
            elif kind in RECORDS:
                if not stacks or not rest or "=" in rest[0]:
                    raise UserError(f"{where}: malformed directive: "
                                    f"'#@ {kind} PATCH base=REV reason=...'")
                rec = {"file": rest[0], "kind": kind, **kv, "_line": str(n)}
                stacks[-1].not_needed.append(rec)
            else:
                raise UserError(f"{where}: unknown directive '#@ {kind}'")
            continue
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        entry = fields[0]
        if any(f not in ("-p1",) for f in fields[1:]):
            raise UserError(f"{where}: unsupported quilt option in '{line}'")
        if not stacks:
            raise UserError(f"{where}: patch '{entry}' comes before any "
                            "'#@ stack' directive")
        if entry in seen:
            raise UserError(f"{where}: '{entry}' listed twice (first at line "
                            f"{seen[entry]})")
        seen[entry] = n
        check_safe_relpath(entry, f"{where}: series entry")
        stacks[-1].patches.append(entry)
        stacks[-1].patch_lines[entry] = n
    for s in stacks:
        for f in s.file_pins:
            if f not in s.patches:
                raise UserError(f"{path.name}: '#@ pin {f}': not a patch of "
                                f"stack '{s.name}'")
    if not stacks or (need_patches and not any(s.patches for s in stacks)):
        raise UserError(f"{path}: the series lists no patch")
    for s in stacks:
        for p in s.patches:
            if not (path.parent / "patches" / p).is_file():
                raise UserError(f"{path.name}: '{p}' is listed but "
                                f"patches/{p} does not exist")
    return Series(path.resolve(), stacks)


def check_safe_relpath(p: str, what: str) -> None:
    pp = PurePosixPath(p)
    if (pp.is_absolute() or ".." in pp.parts or ".git" in pp.parts
            or "\\" in p or not pp.parts):
        raise UserError(f"{what} '{p}' is not a safe relative path")


@dataclasses.dataclass
class Patch:
    file: str
    path: Path
    subject: str
    trailers: list[tuple[str, str]]
    files: list[str]
    raw: bytes

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.trailers if k.lower() == key.lower()]

    @property
    def regression(self) -> list[str]:
        tests = self.values("Tests")
        return tests[0].split() if tests else []

    @property
    def tests(self) -> list[str]:
        out: list[str] = []
        for t in self.values("Tests"):
            out += [x for x in t.split() if x not in out]
        return out


DIFF_GIT = re.compile(rb"^diff --git a/(\S+) b/(\S+)$", re.M)


def load_patch(series: Series, entry: str) -> Patch:
    path = series.patches_dir / entry
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"patches/{entry}: not UTF-8 text") from None
    head, sep, _ = text.partition("\n---\n")
    if not raw.startswith(b"From ") or not sep or b"\ndiff --git " not in raw:
        raise UserError(f"patches/{entry}: not a git format-patch file "
                        "(no mbox header, '---' line or diff)")
    m = re.search(r"^Subject: (.*(?:\n [^\n]*)*)$", head, re.M)
    subject = re.sub(r"\n ", " ", m.group(1)) if m else ""
    body = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    proc = git("interpret-trailers", "--parse", "--no-divider",
               input=body.encode(), cwd=series.root)
    trailers = []
    for line in proc.stdout.decode().splitlines():
        k, _, v = line.partition(":")
        trailers.append((k.strip(), v.strip()))
    files = []
    for a, b in DIFF_GIT.findall(raw):
        for f in (a.decode(), b.decode()):
            if f not in files:
                files.append(f)
    for f in files:
        check_safe_relpath(f, f"patches/{entry}: touches")
    if b"\nGIT binary patch\n" in raw or re.search(rb"^Binary files ", raw, re.M):
        raise UserError(f"patches/{entry}: binary diff (patches must be text)")
    return Patch(entry, path, subject, trailers, files, raw)


def lint_patch(series: Series, p: Patch) -> list[str]:
    """Problems with one patch's headers and content, as messages."""
    probs = []
    where = f"patches/{p.file}"
    if not p.raw.startswith(ZERO_FROM):
        probs.append(f"{where}: not exported with --zero-commit "
                     "(use 'apply.py format-patch')")
    if re.search(rb"^index [0-9a-f]{7,39}\.\.", p.raw, re.M) and not re.search(
        rb"^index [0-9a-f]{40}\.\.[0-9a-f]{40}", p.raw, re.M
    ):
        probs.append(f"{where}: index lines are abbreviated (use --full-index)")
    if re.search(rb"\n-- \n[0-9][^\n]*\n*\Z", p.raw):
        probs.append(f"{where}: ends with a git version signature")
    if not p.subject or not re.match(r"^\[[^\]]+\]", p.subject):
        probs.append(f"{where}: subject needs a component prefix like "
                     "'[Attention][TurboQuant] ...'")
    if not p.values("Bug"):
        probs.append(f"{where}: no 'Bug:' trailer")
    for b in p.values("Bug"):
        if not re.match(r"^https?://\S+$", b):
            probs.append(f"{where}: 'Bug: {b}' is not a URL")
    st = p.values("Upstream-Status")
    if len(st) != 1:
        probs.append(f"{where}: needs exactly one 'Upstream-Status:' trailer")
    elif not UPSTREAM_STATUS.match(st[0]):
        probs.append(f"{where}: invalid 'Upstream-Status: {st[0]}' (Pending | "
                     "Submitted [URL] | Backport [ref] | Inappropriate [reason])")
    if not p.values("Tests"):
        probs.append(f"{where}: no 'Tests:' trailer")
    for t in p.tests:
        f = t.split("::", 1)[0]
        try:
            check_safe_relpath(f, "test")
        except UserError:
            probs.append(f"{where}: test '{t}' is not a path in this project")
            continue
        if not (series.root / f).is_file():
            probs.append(f"{where}: test file '{f}' does not exist")
    if not p.values("Signed-off-by"):
        probs.append(f"{where}: no 'Signed-off-by:' trailer")
    probs += lint_new_python_files(p)
    return probs


def lint_new_python_files(p: Patch) -> list[str]:
    probs = []
    for block in re.split(rb"(?m)^(?=diff --git )", p.raw):
        m = DIFF_GIT.match(block)
        if not m or b"\nnew file mode " not in block.split(b"\n@@", 1)[0]:
            continue
        name = m.group(2).decode()
        if not name.endswith(".py"):
            continue
        added = [ln[1:].decode() for ln in block.split(b"\n")
                 if ln.startswith(b"+") and not ln.startswith(b"+++")]
        if tuple(added[:2]) != SPDX and added:
            probs.append(f"patches/{p.file}: new file {name} lacks vLLM's "
                         "SPDX header lines")
    return probs


# --------------------------------------------------------------------------
# where things live


def cache_dir() -> Path:
    if os.environ.get("VLLM_PATCHES_CACHE"):
        return Path(os.environ["VLLM_PATCHES_CACHE"]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().resolve() / TOOL_NAME


@contextlib.contextmanager
def locked(name: str):
    """One run at a time per repository: the worktrees are shared state."""
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ref_label(rev: str) -> str:
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", rev).strip(".-") or "base"
    return label[:60]


# --------------------------------------------------------------------------
# bases: a user repository, or a cache repository filled from remotes and
# release archives


RELEASE_TAG = re.compile(r"^v?(\d+\.\d+\.\d+(?:\.post\d+)?)$")


@dataclasses.dataclass
class Base:
    repo: Path
    rev: str
    commit: str
    source: str  # "repo" | "cache" | "pypi" | "remote"
    upstream_commit: str | None = None


class BaseUnavailable(Exception):
    def __init__(self, reason: str, hint: str):
        super().__init__(reason)
        self.reason, self.hint = reason, hint


def find_user_repo(arg: str | None) -> Path | None:
    if arg:
        return open_repo(Path(arg).expanduser())
    env = os.environ.get("VLLM_REPO")
    if env:
        return open_repo(Path(env).expanduser())
    local = Path("vllm")
    if (local / ".git").exists():
        return open_repo(local)
    return None


def cache_repo() -> Path:
    repo = cache_dir() / "vllm.git"
    if not (repo / "HEAD").exists():
        repo.parent.mkdir(parents=True, exist_ok=True)
        git("init", "-q", "--bare", str(repo))
        git("config", "gc.auto", "0", cwd=repo)
    return repo


def upstream_commit_of(repo: Path, commit: str) -> str | None:
    msg = gout("log", "-1", "--format=%B", commit, cwd=repo)
    m = re.search(r"^Upstream-Commit: (\S+)$", msg, re.M)
    return m.group(1) if m else None


def resolve_base(stack: Stack, rev: str | None, user_repo: Path | None,
                 offline: bool) -> Base:
    """Find the stack's base, obtaining it into the cache repo if needed."""
    pins = stack.pins
    candidates = [rev] if rev else [
        r for r in (pins.get("commit"), pins.get("tag"), pins.get("branch")) if r
    ]
    if user_repo is not None:
        for r in candidates:
            c = rev_commit(user_repo, r)
            if c:
                return Base(user_repo, r, c, "repo")
        if rev:
            raise UserError(f"unknown revision '{rev}' in {user_repo}")
        raise BaseUnavailable(
            f"{user_repo} has none of {', '.join(candidates)}",
            stack.fetch_hint(user_repo))
    repo = cache_repo()
    shown = rev or pins.get("tag") or pins.get("commit") or pins["branch"]
    for r in candidates:
        c = rev_commit(repo, r)
        if c:
            return Base(repo, shown, c, "cache", upstream_commit_of(repo, c))
    errors = []
    url = pins.get("repo", UPSTREAM_URL)
    if not offline:
        want = rev or pins.get("fetch") or pins.get("commit") or pins.get("tag")
        if want:
            c = fetch_remote(repo, url, want)
            if c:
                return Base(repo, shown, c, "remote", c)
            errors.append(f"{url} is unreachable or lacks {want}")
    release = None
    tag = rev or pins.get("tag")
    if tag and RELEASE_TAG.match(tag) and url.rstrip("/") == UPSTREAM_URL:
        release = RELEASE_TAG.match(tag).group(1)
    if release is None and rev and RELEASE_TAG.match(rev):
        release = RELEASE_TAG.match(rev).group(1)
    if release:
        c = materialize_release(repo, release)
        up = upstream_commit_of(repo, c)
        pin = pins.get("commit")
        if not rev and pin and up and not pin.startswith(up):
            say(f"warning: PyPI {release} says it was built from {up}, but the "
                f"stack pins {pin}")
        return Base(repo, shown, c, "pypi", up)
    if rev and re.fullmatch(r"[0-9a-f]{7,40}", rev) is None and not errors:
        raise UserError(f"unknown revision '{rev}': not a release (vX.Y.Z) and "
                        "no repository given (--repo)")
    raise BaseUnavailable(
        "; ".join(errors) or f"base {shown} is not a release and not cached",
        stack.fetch_hint(repo))


def fetch_remote(repo: Path, url: str, want: str) -> str | None:
    timeout = float(os.environ.get("VLLM_PATCHES_FETCH_TIMEOUT", "60"))
    ref = f"refs/{TOOL_NAME}/fetched/{ref_label(want)}"
    src = want
    if RELEASE_TAG.match(want):
        src = f"refs/tags/{want}"
    try:
        proc = git("fetch", "--quiet", "--depth=1", "--no-tags", url,
                   f"+{src}:{ref}", cwd=repo, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return rev_commit(repo, ref)


def pip_platform_args() -> list[str]:
    # pip matches platform tags exactly: name every glibc a release may target.
    plats = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
    plats.append("manylinux2014_x86_64")
    args = ["--python-version", "3.12", "--implementation", "cp"]
    for p in plats:
        args += ["--platform", p]
    return args


def release_wheel(version: str) -> Path:
    """The official wheel of a release: from the cache, or downloaded by pip."""
    dist = cache_dir() / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    found = sorted(dist.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    say(f"apply.py: downloading the vllm {version} release wheel with pip "
        "(about 250 MB, once; cached in {})".format(dist))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dist) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary=:all:", "--progress-bar", "off", "--disable-pip-version-check",
               *pip_platform_args(), "-d", tmp, f"vllm=={version}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail = []
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith("WARNING: Location"):
                continue
            tail = (tail + [line])[-5:]
            if line.startswith(("Collecting", "Downloading", "Saved")):
                say(f"  pip: {line.strip()}")
        if proc.wait() != 0:
            raise BaseUnavailable(
                f"pip could not download vllm=={version}: {' / '.join(tail)}",
                f"pip download --no-deps --only-binary=:all: vllm=={version} "
                f"-d {dist}")
        got = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if not got:
            raise BaseUnavailable(f"pip gave no vllm {version} wheel",
                                  f"pip download vllm=={version}")
        final = dist / got[0].name
        os.replace(got[0], final)
    say(f"  downloaded {final.name} ({final.stat().st_size / 1e6:.0f} MB) in "
        f"{time.monotonic() - t0:.0f} s")
    return final


def materialize_release(repo: Path, version: str,
                        wheel: Path | None = None) -> str:
    """Commit a release's Python sources (from its wheel) as tag vX.Y.Z.

    One root commit per release, all of vllm/ but compiled extensions, with
    fixed author, committer and date, so the same release gives the same
    commit id everywhere. The upstream commit the release was built from
    (vllm/_version.py's __commit_id__) is recorded as a trailer.
    """
    import zipfile

    tag = f"v{version}"
    c = rev_commit(repo, f"refs/tags/{tag}")
    if c:
        return c
    wheel = wheel or release_wheel(version)
    say(f"apply.py: committing {wheel.name} as {tag} in {repo}")
    upstream = None
    stream = tempfile.TemporaryFile()
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist()
                       if n.startswith("vllm/") and not n.endswith("/")
                       and not re.search(r"\.so(\.\d+)*$", n))
        if not names:
            raise UserError(f"{wheel}: no vllm/ sources inside")
        for n in names:
            data = zf.read(n)
            mode = "100755" if (zf.getinfo(n).external_attr >> 16) & 0o111 else \
                "100644"
            if n == "vllm/_version.py":
                m = re.search(rb"__commit_id__ = commit_id = '(?:g)?([0-9a-f]+)'",
                              data)
                upstream = m.group(1).decode() if m else None
            stream.write(f"M {mode} inline {n}\ndata {len(data)}\n".encode())
            stream.write(data + b"\n")
    msg = (f"vLLM {version} (Python sources of the release wheel)\n\n"
           f"Materialized by apply.py from {wheel.name}: every file under vllm/\n"
           "except compiled extensions.\n\n"
           f"Release: {version}\n"
           + (f"Upstream-Commit: {upstream}\n" if upstream else "")).encode()
    ident = f"{IDENTITY[0]} <{IDENTITY[1]}> {BASE_DATE}"
    header = (f"commit refs/{TOOL_NAME}/import\n"
              f"author {ident}\ncommitter {ident}\n"
              f"data {len(msg)}\n").encode() + msg + b"deleteall\n"
    stream.seek(0)
    fi = subprocess.Popen(["git", "fast-import", "--quiet", "--force"],
                          cwd=repo, stdin=subprocess.PIPE)
    assert fi.stdin is not None
    fi.stdin.write(header)
    shutil.copyfileobj(stream, fi.stdin)
    fi.stdin.write(b"\n")
    fi.stdin.close()
    if fi.wait() != 0:
        raise UserError(f"git fast-import failed while committing {wheel.name}")
    c = gout("rev-parse", f"refs/{TOOL_NAME}/import", cwd=repo)
    git("update-ref", f"refs/tags/{tag}", c, cwd=repo)
    git("update-ref", "-d", f"refs/{TOOL_NAME}/import", cwd=repo)
    return c


# --------------------------------------------------------------------------
# worktrees of the tool's own


def worktree(repo: Path, key: str, commit: str) -> Path:
    """A worktree of the tool's own at `commit`, reused and reset between runs.

    Whatever a killed run left (an am in progress, a stale index lock, a
    half-made worktree) is cleared here, so the next run starts clean.
    """
    rid = hashlib.sha1(str(git_common_dir(repo)).encode()).hexdigest()[:10]
    path = cache_dir() / "worktrees" / rid / key
    listed = gout("worktree", "list", "--porcelain", cwd=repo)
    registered = f"worktree {path}" in listed.splitlines()
    usable = registered and (path / ".git").is_file()
    if usable:
        admin = Path(gout("rev-parse", "--path-format=absolute", "--git-dir",
                          cwd=path))
        for stale in ("index.lock", "HEAD.lock"):
            (admin / stale).unlink(missing_ok=True)
        shutil.rmtree(admin / "rebase-apply", ignore_errors=True)
        proc = git("checkout", "-q", "-f", "--detach", commit, cwd=path,
                   check=False)
        usable = proc.returncode == 0
        if usable:
            git("clean", "-fdq", "-e", "__pycache__", cwd=path)
    if not usable:
        if registered:
            git("worktree", "remove", "--force", "--force", str(path), cwd=repo,
                check=False)
        shutil.rmtree(path, ignore_errors=True)
        git("worktree", "prune", cwd=repo)
        path.parent.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "-q", "--detach", str(path), commit, cwd=repo)
    return path


# --------------------------------------------------------------------------
# applying


@dataclasses.dataclass
class PatchResult:
    file: str
    apply: str = "skipped"  # clean | 3way | conflict | not-needed | skipped
    regression_base: str = "skip"
    regression_patched: str = "skip"
    tests: str = "skip"
    seconds: float = 0.0
    conflict_files: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    test_outcomes: dict[str, dict[str, str]] = dataclasses.field(
        default_factory=dict)

    def ok(self) -> bool:
        if self.apply == "not-needed":
            return True
        return (self.apply in ("clean", "3way") and self.regression_base == "fail"
                and self.regression_patched == "pass"
                and self.tests in ("pass", "skip"))

    def to_json(self) -> dict:
        d = {"file": self.file, "apply": self.apply,
             "regression": {"base": self.regression_base,
                            "patched": self.regression_patched},
             "tests": self.tests, "seconds": round(self.seconds, 2)}
        if self.conflict_files:
            d["conflict_files"] = self.conflict_files
        if self.detail:
            d["detail"] = self.detail
        if self.test_outcomes:
            d["test_outcomes"] = self.test_outcomes
        return d


def am(wt: Path, patches: list[Path], three_way: bool) -> subprocess.CompletedProcess:
    return git("am", "-q", "-k", "--committer-date-is-author-date",
               "--3way" if three_way else "--no-3way", *map(str, patches),
               cwd=wt, check=False, config=AM_CONFIG)


def conflicted_files(wt: Path, am_output: str) -> list[str]:
    files = gout("diff", "--name-only", "--diff-filter=U", cwd=wt).splitlines()
    if not files:
        for m in re.finditer(r"error: (?:patch failed: |)([^:\s]+)(?::\d+| does not"
                             r" exist in index|: No such file)", am_output):
            if m.group(1) not in files:
                files.append(m.group(1))
    return files


def apply_stack(wt: Path, patches: list[Patch],
                results: dict[str, PatchResult]) -> list[Patch]:
    """git am the patches in order; returns those that stopped on a conflict.

    The whole stack goes through one git am, as fast as plain git am. A patch
    that does not apply as is is retried alone with the 3-way fallback.
    Conflicting patches are left out (their later patches still tried).
    """
    todo = list(patches)
    conflicts: list[Patch] = []
    while todo:
        start = gout("rev-parse", "HEAD", cwd=wt)
        t0 = time.monotonic()
        proc = am(wt, [p.path for p in todo], three_way=False)
        n = int(gout("rev-list", "--count", f"{start}..HEAD", cwd=wt))
        dt = (time.monotonic() - t0) / max(1, n + (proc.returncode != 0))
        for p in todo[:n]:
            results[p.file].apply = "clean"
            results[p.file].seconds += dt
        if proc.returncode == 0:
            break
        git("am", "--quit", cwd=wt, check=False)
        git("reset", "-q", "--hard", "HEAD", cwd=wt)
        stuck = todo[n]
        todo = todo[n + 1:]
        t0 = time.monotonic()
        proc3 = am(wt, [stuck.path], three_way=True)
        res = results[stuck.file]
        res.seconds += time.monotonic() - t0
        if proc3.returncode == 0:
            res.apply = "3way"
            continue
        out = (proc.stdout + proc.stderr + proc3.stdout + proc3.stderr).decode(
            errors="replace")
        res.apply = "conflict"
        res.conflict_files = conflicted_files(wt, out)
        res.detail = "; ".join(ln for ln in out.splitlines()
                               if ln.startswith("error:"))[:500]
        git("am", "--abort", cwd=wt, check=False)
        conflicts.append(stuck)
    return conflicts


# --------------------------------------------------------------------------
# targeted tests


def test_python(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("VLLM_PATCHES_PYTHON"):
        return os.environ["VLLM_PATCHES_PYTHON"]
    venv = PROJECT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


SELECT_PLUGIN = """\
# Written by apply.py: keep only the requested node ids. Passing node ids to
# pytest directly would stop the whole run at the first one that cannot be
# collected (an import error on a base, say); this way that module reports an
# error and every other test still runs.
import os


def pytest_collection_modifyitems(config, items):
    want = os.environ["VLLM_PATCHES_SELECT"].split("\\n")

    def keep(nid):
        return any(nid == w or nid.startswith((w + "::", w + "[")) for w in want)

    gone = [i for i in items if not keep(i.nodeid)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if keep(i.nodeid)]
"""


def run_tests(root: Path, tree: Path, node_ids: list[str], python: str,
              label: str) -> tuple[dict[str, tuple[str, float]], str]:
    """Run pytest on node ids against a tree; outcome and seconds per id."""
    if not node_ids:
        return {}, ""
    # a missing file would stop pytest before it runs anything: leave it out,
    # and its node ids come out as errors
    files = [f for f in dict.fromkeys(n.split("::", 1)[0] for n in node_ids)
             if (root / f).exists()]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        (Path(tmp) / "vllm_patches_select.py").write_text(SELECT_PLUGIN)
        pypath = os.pathsep.join(
            x for x in (tmp, os.environ.get("PYTHONPATH", "")) if x)
        env = dict(os.environ, VLLM_TREE=str(tree), PYTHONUNBUFFERED="1",
                   PYTHONPATH=pypath, VLLM_PATCHES_SELECT="\n".join(node_ids))
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "vllm_patches_select", f"--rootdir={root}",
               "-o", "junit_family=xunit1", f"--junitxml={xml}",
               "--continue-on-collection-errors", *files]
        say(f"apply.py: pytest ({label}): {len(node_ids)} node id(s)")
        timeout = float(os.environ.get("VLLM_PATCHES_TEST_TIMEOUT", "3600"))
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True,
                                  text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            output = f"pytest timed out after {timeout:.0f} s\n{e.stdout or ''}"
        except OSError as e:
            raise UserError(f"cannot run the test Python '{python}': {e}") from None
        cases = parse_junit(xml) if xml.exists() else []
    out: dict[str, tuple[str, float]] = {}
    for nid in node_ids:
        mine = [(o, s) for cid, o, s in cases if covers(nid, cid)]
        outs = {o for o, _ in mine}
        secs = sum(s for _, s in mine)
        if not outs or "error" in outs:
            out[nid] = ("error", secs)
        elif "fail" in outs:
            out[nid] = ("fail", secs)
        elif outs == {"skip"}:
            out[nid] = ("skip", secs)
        else:
            out[nid] = ("pass", secs)
    return out, output


def covers(requested: str, case: str) -> bool:
    if case == requested:
        return True
    if case.startswith(requested + "::") or case.startswith(requested + "["):
        return True
    # a collection error is reported against the module
    return "::" not in case and requested.split("::")[0] == case


def parse_junit(xml: Path) -> list[tuple[str, str, float]]:
    """(node id, outcome, seconds) per test case of a pytest xunit1 report."""
    import xml.etree.ElementTree as ET

    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        f, cls, name = (tc.get(k) or "" for k in ("file", "classname", "name"))
        if not cls:  # a collection error: the name is the module's dotted path
            cid = f or name.replace(".", "/") + ".py"
        else:
            module = f[:-3].replace("/", ".") if f.endswith(".py") else f
            klass = cls[len(module) + 1:] if cls.startswith(module + ".") else ""
            cid = "::".join(x for x in (f, klass, name) if x)
        if tc.find("failure") is not None:
            o = "fail"
        elif tc.find("error") is not None:
            o = "error"
        elif tc.find("skipped") is not None:
            o = "skip"
        else:
            o = "pass"
        cases.append((cid, o, float(tc.get("time") or 0.0)))
    return cases


def aggregate(outcomes: list[str], want_fail: bool) -> str:
    """One word for a set of test outcomes.

    Regression tests on the base (want_fail): "fail" only when every one of
    them fails, "pass" only when every one passes; a mix, or an error, is
    "error" (the per-test outcomes are in the report). Elsewhere: any error
    is "error", else any failure "fail", else "pass" ("skip" if all skipped).
    """
    s = set(outcomes)
    if not s or s == {"skip"}:
        return "skip"
    if want_fail:
        return s.pop() if s in ({"fail"}, {"pass"}) else "error"
    if "error" in s:
        return "error"
    return "fail" if "fail" in s else "pass"


# --------------------------------------------------------------------------
# the main job


def run_stack(series: Series, stack: Stack, patches: list[Patch],
              rev: str | None, user_repo: Path | None,
              args: argparse.Namespace) -> dict:
    t_stack = time.monotonic()
    rep: dict = {"name": stack.name, "pins": stack.pins,
                 "base": rev or stack.pins.get("tag") or stack.pins.get("commit")}
    try:
        base = resolve_base(stack, rev, user_repo, args.offline)
    except BaseUnavailable as e:
        rep.update(status="skipped", reason=e.reason, fetch=e.hint,
                   patches=[PatchResult(p).to_json() for p in stack.patches])
        return rep
    rep.update(base=base.rev, base_commit=base.commit, source=base.source,
               repo=str(base.repo))
    if base.upstream_commit:
        rep["upstream_commit"] = base.upstream_commit
    results = {p.file: PatchResult(p.file) for p in patches}
    label = ref_label(base.rev)
    with locked(hashlib.sha1(str(git_common_dir(base.repo)).encode())
                .hexdigest()[:10]):
        wt = worktree(base.repo, f"{stack.name}-patched", base.commit)
        conflicts = apply_stack(wt, patches, results)
        head = gout("rev-parse", "HEAD", cwd=wt)
        branch = f"{REF_NS}/{stack.name}/{label}"
        git("update-ref", branch, head, cwd=base.repo)
        rep.update(branch=branch, head=head, worktree=str(wt))
        if not args.no_tests:
            base_wt = worktree(base.repo, f"{stack.name}-base", base.commit)
            python = test_python(args.python)
            reg_ids: list[str] = []
            for p in patches:
                reg_ids += [t for t in p.regression if t not in reg_ids]
            on_base, log_base = run_tests(series.root, base_wt, reg_ids, python,
                                          f"{stack.name}, unpatched base")
            applied = [p for p in patches if results[p.file].apply in
                       ("clean", "3way")]
            all_ids: list[str] = []
            for p in applied:
                all_ids += [t for t in p.tests if t not in all_ids]
            on_patched, log_patched = run_tests(
                series.root, wt, all_ids, python, f"{stack.name}, patched")
            for p in patches:
                r = results[p.file]
                r.regression_base = aggregate(
                    [on_base[t][0] for t in p.regression if t in on_base], True)
                r.seconds += sum(on_base[t][1] for t in p.regression if t in on_base)
                r.test_outcomes["base"] = {t: on_base[t][0] for t in p.regression
                                           if t in on_base}
                if p in conflicts and r.regression_base == "pass":
                    r.apply = "not-needed"
                    r.detail = ("does not apply, and its regression tests pass "
                                "on the unpatched base")
                if r.apply not in ("clean", "3way"):
                    continue
                r.regression_patched = aggregate(
                    [on_patched[t][0] for t in p.regression], False)
                rest = [t for t in p.tests if t not in p.regression]
                r.tests = aggregate([on_patched[t][0] for t in p.tests], False)
                r.seconds += sum(on_patched[t][1] for t in rest)
                r.seconds += sum(on_patched[t][1] for t in p.regression)
                r.test_outcomes["patched"] = {t: on_patched[t][0] for t in p.tests}
            rep["logs"] = {"base": log_base[-20000:], "patched": log_patched[-20000:]}
    rep["status"] = "ran"
    rep["patches"] = [results[p.file].to_json() for p in patches]
    rep["ok"] = all(results[p.file].ok() for p in patches) if not args.no_tests \
        else all(results[p.file].apply in ("clean", "3way") for p in patches)
    rep["seconds"] = round(time.monotonic() - t_stack, 2)
    return rep


def print_table(report: dict) -> None:
    for st in report["stacks"]:
        print()
        if st["status"] == "skipped":
            print(f"== stack {st['name']}: SKIPPED, not verified: base "
                  f"{st['base']} unavailable")
            print(f"   reason: {st['reason']}")
            print(f"   to get it: {st['fetch']}")
            continue
        src = st["source"]
        up = f", upstream {st['upstream_commit']}" if st.get("upstream_commit") else ""
        print(f"== stack {st['name']} on {st['base']} ({st['base_commit'][:12]}, "
              f"from {src}{up})")
        rows = [("patch", "apply", "regr. base", "regr. patched", "tests", "secs")]
        for p in st["patches"]:
            rows.append((p["file"], p["apply"], p["regression"]["base"],
                         p["regression"]["patched"], p["tests"],
                         f"{p['seconds']:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for i, r in enumerate(rows):
            print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                print("  " + "  ".join("-" * w for w in widths))
        for p in st["patches"]:
            if p.get("conflict_files"):
                print(f"  {p['file']}: conflicts in {', '.join(p['conflict_files'])}")
        print(f"  result: {'OK' if st['ok'] else 'FAILED'}; patched tree: "
              f"{st['branch']} in {st['repo']}")
    skipped = [s for s in report["stacks"] if s["status"] == "skipped"]
    if skipped:
        print()
        print("WARNING: not verified (base unavailable): " +
              ", ".join(s["name"] for s in skipped))


def cmd_apply(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    loaded = {p: load_patch(series, p) for s in series.stacks for p in s.patches}
    user_repo = find_user_repo(args.repo)
    if args.base and not args.stack and len(series.stacks) > 1:
        say(f"apply.py: --base without --stack: using the first stack, "
            f"'{series.stacks[0].name}'")
    stacks = [series.stack(args.stack)] if (args.stack or args.base) else \
        series.stacks
    report = {"tool": "apply.py", "series": str(series.path), "stacks": []}
    for st in stacks:
        report["stacks"].append(run_stack(series, st, [loaded[p] for p in
                                                       st.patches],
                                          args.base, user_repo, args))
    ran = [s for s in report["stacks"] if s["status"] == "ran"]
    failed = [s for s in ran if not s["ok"]]
    skipped = [s for s in report["stacks"] if s["status"] == "skipped"]
    code = 1 if failed or (args.require_all and skipped) or not ran else 0
    report["exit_code"] = code
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return code


# --------------------------------------------------------------------------
# check


def check_agreement(series: Series) -> None:
    """Every patch file is in the series (or recorded there), and vice versa."""
    listed = {p for s in series.stacks for p in s.patches}
    recorded = {r["file"] for s in series.stacks for r in s.not_needed}
    on_disk = {p.relative_to(series.patches_dir).as_posix()
               for p in series.patches_dir.rglob("*.patch")}
    for extra in sorted(on_disk - listed - recorded):
        raise UserError(f"patches/{extra} is not in the series (list it, or "
                        "remove the file)")
    for gone in sorted(recorded - on_disk):
        raise UserError(f"series: record for missing patches/{gone}")


def cmd_check(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    problems: list[str] = []
    checked = 0
    for st in series.stacks:
        loaded = []
        for entry in st.patches:
            p = load_patch(series, entry)
            problems += lint_patch(series, p)
            loaded.append(p)
            checked += 1
        problems += roundtrip(series, st, loaded, find_user_repo(args.repo))
    for pr in problems:
        print(pr)
    if problems:
        say(f"apply.py check: {len(problems)} problem(s)")
        return 1
    print(f"apply.py check: {checked} patches in {len(series.stacks)} stacks: ok")
    return 0


def roundtrip(series: Series, stack: Stack, patches: list[Patch],
              user_repo: Path | None) -> list[str]:
    """Re-export each patch from its base (when at hand) and compare bytes.

    Offline and without a checkout: the patches are applied to the base's
    tree in a temporary index, committed with their own author, date and
    message, and exported again.
    """
    base = None
    for repo in (user_repo, cache_dir() / "vllm.git"):
        if repo is None or not (repo.is_dir() and
                                (repo / "HEAD").exists() or (repo / ".git").exists()):
            continue
        for r in (stack.pins.get("commit"), stack.pins.get("tag"),
                  stack.pins.get("branch")):
            base = rev_commit(repo, r) if r else None
            if base:
                break
        if base:
            break
    if base is None:
        print(f"note: stack {stack.name}: base not at hand, export round-trip "
              "not checked (run 'apply.py base --stack NAME' first)")
        return []
    probs = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", base, cwd=repo, env=env)
        parent = base
        for p in patches:
            info = git("mailinfo", "-k", "-b", str(Path(tmp) / "msg"),
                       str(Path(tmp) / "diff"), cwd=repo, input=p.raw).stdout
            hdr = dict(ln.split(": ", 1) for ln in info.decode().splitlines()
                       if ": " in ln)
            msg = hdr.get("Subject", "") + "\n\n" + (Path(tmp) / "msg").read_text()
            proc = git("apply", "--cached", str(Path(tmp) / "diff"), cwd=repo,
                       env=env, check=False)
            if proc.returncode != 0:
                probs.append(f"patches/{p.file}: does not apply to the stack's "
                             "base in order")
                break
            tree = gout("write-tree", cwd=repo, env=env)
            cenv = dict(env, GIT_AUTHOR_NAME=hdr.get("Author", ""),
                        GIT_AUTHOR_EMAIL=hdr.get("Email", ""),
                        GIT_AUTHOR_DATE=hdr.get("Date", ""),
                        GIT_COMMITTER_NAME=IDENTITY[0],
                        GIT_COMMITTER_EMAIL=IDENTITY[1],
                        GIT_COMMITTER_DATE=hdr.get("Date", ""))
            commit = gout("commit-tree", tree, "-p", parent, cwd=repo, env=cenv,
                          input=msg.rstrip("\n").encode() + b"\n")
            again = format_patch(repo, commit)
            if again != p.raw:
                probs.append(f"patches/{p.file}: re-export differs (not a "
                             "deterministic export; use 'apply.py format-patch')")
            parent = commit
    if not probs:
        print(f"stack {stack.name}: export round-trip on {base[:12]}: "
              "byte-identical")
    return probs


# --------------------------------------------------------------------------
# test, base, format-patch


def cmd_test(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    tree = Path(args.tree).expanduser().resolve()
    if not (tree / "vllm" / "__init__.py").is_file():
        raise UserError(f"{tree}: not a vLLM tree (no vllm/__init__.py)")
    entries = [p for s in series.stacks for p in s.patches]
    chosen = []
    for want in args.patches or entries:
        match = [e for e in entries if e == want or Path(e).name == want
                 or Path(e).name.startswith(want)]
        if len(match) != 1:
            raise UserError(f"'{want}': no single patch of the series matches")
        chosen.append(load_patch(series, match[0]))
    ids: list[str] = []
    for p in chosen:
        ids += [t for t in p.tests if t not in ids]
    out, log = run_tests(series.root, tree, ids, test_python(args.python), "tree")
    print(log.rstrip()[-4000:])
    rows = []
    code = 0
    for p in chosen:
        r = aggregate([out[t][0] for t in p.tests], False)
        rows.append({"file": p.file, "tests": r,
                     "outcomes": {t: out[t][0] for t in p.tests}})
        print(f"  {p.file}: {r}")
        if r in ("fail", "error"):
            code = 1
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": str(tree), "patches": rows},
                                              indent=2) + "\n")
    return code


def cmd_base(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series), need_patches=False)
    stack = series.stack(args.stack)
    user_repo = find_user_repo(args.repo)
    try:
        base = resolve_base(stack, args.rev, user_repo, args.offline)
    except BaseUnavailable as e:
        say(f"apply.py: base unavailable: {e.reason}\n  to get it: {e.hint}")
        return 1
    up = f" upstream={base.upstream_commit}" if base.upstream_commit else ""
    print(f"{base.rev} {base.commit} repo={base.repo} source={base.source}{up}")
    return 0


def cmd_format_patch(args: argparse.Namespace) -> int:
    repo = open_repo(Path(args.repo))
    if not rev_commit(repo, args.rev):
        raise UserError(f"unknown revision '{args.rev}' in {repo}")
    data = format_patch(repo, args.rev)
    if args.out:
        Path(args.out).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
    return 0


# --------------------------------------------------------------------------
# rebase, status, time machine


def stack_directive(name: str, pins: dict[str, str]) -> str:
    order = ["repo", "tag", "branch", "commit", "upstream", "pypi", "fetch"]
    return " ".join([f"#@ stack {name}"] + [f"{k}={shlex.quote(pins[k])}"
                                             for k in order if pins.get(k)])


def record_line(rec: dict[str, str]) -> str:
    extra = "".join(f" {k}={shlex.quote(v)}" for k, v in rec.items()
                    if k not in ("file", "kind") and not k.startswith("_"))
    return f"#@ {rec['kind']} {rec['file']}{extra}\n"


def rewrite_series(series: Series, stack: Stack, pins: dict[str, str],
                   records: list[dict[str, str]]) -> str:
    """The series text with the stack re-pinned and `records` taken out of
    its active list (kept as '#@ not-needed' / '#@ dropped' lines)."""
    lines = series.path.read_text().splitlines(keepends=True)
    gone = {stack.patch_lines[r["file"]] for r in records}
    last = max([stack.lineno, *stack.patch_lines.values(),
                *(int(r.get("_line", 0)) for r in stack.not_needed)])
    out = []
    for n, line in enumerate(lines, 1):
        if n == stack.lineno:
            out.append(stack_directive(stack.name, pins) + "\n")
        elif n not in gone:
            out.append(line if line.endswith("\n") else line + "\n")
        if n == last:
            out += [record_line(r) for r in records]
    return "".join(out)


def new_pins(stack: Stack, base: Base) -> dict[str, str]:
    pins = {k: v for k, v in stack.pins.items()
            if k not in ("tag", "branch", "commit", "upstream", "fetch")}
    if RELEASE_TAG.match(base.rev):
        pins["tag"] = base.rev if base.rev.startswith("v") else f"v{base.rev}"
    elif not re.fullmatch(r"[0-9a-f]{7,40}", base.rev):
        pins["branch"] = base.rev
    if base.source in ("repo", "remote"):
        pins["commit"] = base.commit
    elif base.upstream_commit:
        # a release materialized from its wheel: the wheel names the upstream
        # commit (often abbreviated); the full id is not known offline
        pins["upstream"] = base.upstream_commit
    return pins


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Rebase:
    """A rebase of one stack onto a new base, resumable after a conflict.

    Its state lives in the tool's cache (never in the project), and the new
    patch files are staged there too: the series and patches/ change only
    when the whole rebase has succeeded.
    """

    def __init__(self, series: Series, args: argparse.Namespace):
        self.series = series
        self.args = args
        key = hashlib.sha1(str(series.path).encode()).hexdigest()[:10]
        self.dir = cache_dir() / "rebase" / key
        self.file = self.dir / "state.json"
        self.state: dict = {}

    # state -------------------------------------------------------------
    def load(self) -> dict | None:
        if not self.file.exists():
            return None
        self.state = json.loads(self.file.read_text())
        return self.state

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.file, json.dumps(self.state, indent=1).encode())

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def stale(self) -> bool:
        """A 'running' state whose process is gone: a crashed rebase."""
        if self.state.get("phase") != "running":
            return False
        try:
            os.kill(int(self.state["pid"]), 0)
        except (OSError, ValueError):
            return True
        return False

    # steps -------------------------------------------------------------
    def start(self, stack: Stack, onto: str, user_repo: Path | None) -> int:
        if self.load():
            if self.stale():
                say("apply.py: a crashed rebase left state behind; starting over")
                self.discard()
            else:
                raise UserError(
                    f"a rebase of stack '{self.state['stack']}' onto "
                    f"{self.state['onto']} is in progress: apply.py rebase "
                    "--continue | --skip | --abort")
        try:
            base = resolve_base(stack, onto, user_repo, self.args.offline)
        except BaseUnavailable as e:
            raise UserError(f"base {onto} unavailable: {e.reason} ({e.hint})") \
                from None
        wt = worktree(base.repo, f"{stack.name}-rebase", base.commit)
        old_base, old_head = self.old_stack(stack, base.repo)
        self.state = {
            "series": str(self.series.path), "stack": stack.name, "onto": onto,
            "base": dataclasses.asdict(base) | {"repo": str(base.repo)},
            "worktree": str(wt), "pid": os.getpid(), "phase": "running",
            "next": 0, "results": [], "staged": {}, "old_base": old_base,
            "old_head": old_head,
        }
        self.save()
        return self.run()

    def old_stack(self, stack: Stack, repo: Path) -> tuple[str | None, str | None]:
        """The old stack applied on its old base, for range-diff (if at hand)."""
        for r in (stack.pins.get("commit"), stack.pins.get("tag")):
            c = rev_commit(repo, r) if r else None
            if c:
                wt = worktree(repo, f"{stack.name}-rebase-old", c)
                patches = [load_patch(self.series, p) for p in stack.patches]
                res = {p.file: PatchResult(p.file) for p in patches}
                if not apply_stack(wt, patches, res):
                    return c, gout("rev-parse", "HEAD", cwd=wt)
        return None, None

    def run(self) -> int:
        st = self.state
        stack = self.series.stack(st["stack"])
        patches = [load_patch(self.series, p) for p in stack.patches]
        wt = Path(st["worktree"])
        st["phase"], st["pid"] = "running", os.getpid()
        while st["next"] < len(patches):
            p = patches[st["next"]]
            pre = gout("rev-parse", "HEAD", cwd=wt)
            st["pre_head"] = pre
            self.save()
            proc = am(wt, [p.path], three_way=False)
            outcome = "clean"
            if proc.returncode != 0:
                git("am", "--abort", cwd=wt, check=False)
                proc = am(wt, [p.path], three_way=True)
                outcome = "3way"
            if proc.returncode != 0:
                out = (proc.stdout + proc.stderr).decode(errors="replace")
                files = conflicted_files(wt, out)
                git("am", "--abort", cwd=wt, check=False)
                git("reset", "-q", "--hard", pre, cwd=wt)
                verdict, detail = self.regression_without(p, wt)
                if verdict == "pass":
                    self.record(p, "not-needed", "does not apply; its regression "
                                f"tests pass on {st['onto']} without it")
                    continue
                am(wt, [p.path], three_way=True)  # the conflict, for the user
                st.update(phase="stopped", conflict_files=files,
                          conflict_detail=detail)
                self.save()
                self.print_stop(p, files, detail)
                return 1
            self.keep(p, wt, outcome)
        return self.finish(stack, patches)

    def regression_without(self, p: Patch, wt: Path) -> tuple[str, str]:
        res, _ = run_tests(self.series.root, wt, p.regression,
                           test_python(self.args.python),
                           f"{p.file} regression, new base without it")
        verdict = aggregate([res[t][0] for t in p.regression], True)
        return verdict, ", ".join(f"{t}: {res[t][0]}" for t in p.regression)

    def keep(self, p: Patch, wt: Path, outcome: str) -> None:
        st = self.state
        staged = self.dir / "staged" / p.file
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(format_patch(wt, "HEAD"))
        st["staged"][p.file] = str(staged)
        st["results"].append({"file": p.file, "outcome": outcome})
        st["next"] += 1
        self.save()

    def record(self, p: Patch, kind: str, reason: str) -> None:
        st = self.state
        st["results"].append({"file": p.file, "outcome": kind, "reason": reason})
        st["next"] += 1
        self.save()

    def print_stop(self, p: Patch, files: list[str], detail: str) -> None:
        wt = self.state["worktree"]
        print(f"CONFLICT: {p.file} does not apply to {self.state['onto']}, and "
              f"its regression tests fail there without it ({detail}).")
        print(f"  conflicting files (in {wt}):")
        for f in files:
            print(f"    {f}")
        cmd = "python apply.py rebase"
        if self.series.path != (PROJECT / "series").resolve():
            cmd += f" --series {shlex.quote(str(self.series.path))}"
        print("  resolve them there, 'git add' them, then one of:")
        print(f"    {cmd} --continue   # commit the resolution (git am "
              "--continue) and go on")
        print(f"    {cmd} --skip       # drop this patch from the stack and go on")
        print(f"    {cmd} --abort      # stop; series and patches stay as they "
              "were")

    def resume(self, how: str) -> int:
        if not self.load():
            raise UserError("no rebase in progress")
        st = self.state
        wt = Path(st["worktree"])
        stack = self.series.stack(st["stack"])
        in_am = (Path(gout("rev-parse", "--path-format=absolute", "--git-dir",
                           cwd=wt)) / "rebase-apply").exists()
        if how == "abort":
            if in_am:
                git("am", "--abort", cwd=wt, check=False)
            self.discard()
            print(f"rebase of stack '{st['stack']}' aborted: series and patches "
                  "unchanged")
            return 0
        if st.get("phase") != "stopped" and not self.stale():
            raise UserError("the rebase is not stopped at a conflict")
        patches = [load_patch(self.series, p) for p in stack.patches]
        p = patches[st["next"]]
        if how == "skip":
            if in_am:
                git("am", "--abort", cwd=wt, check=False)
            git("reset", "-q", "--hard", st["pre_head"], cwd=wt)
            self.record(p, "dropped", f"skipped by hand during the rebase onto "
                        f"{st['onto']} (did not apply; regression tests failed "
                        "without it)")
            return self.run()
        if in_am:
            unmerged = gout("diff", "--name-only", "--diff-filter=U", cwd=wt)
            if unmerged:
                raise UserError(f"still unresolved in {wt}: "
                                f"{' '.join(unmerged.split())} (edit, git add, "
                                "then --continue)")
            proc = git("am", "--continue", cwd=wt, check=False, config=AM_CONFIG)
            if proc.returncode != 0:
                err = (proc.stdout + proc.stderr).decode(errors="replace")
                last = (err.strip().splitlines() or ["?"])[-1]
                raise UserError(f"git am --continue failed in {wt}: {last}")
        head = gout("rev-parse", "HEAD", cwd=wt)
        parent = gout("rev-parse", "HEAD^", cwd=wt, check=False)
        if parent != st["pre_head"]:
            raise UserError(f"expected exactly one commit on top of "
                            f"{st['pre_head'][:12]} in {wt} (found {head[:12]})")
        self.keep(p, wt, "resolved")
        return self.run()

    def finish(self, stack: Stack, patches: list[Patch]) -> int:
        st = self.state
        base = Base(**(st["base"] | {"repo": Path(st["base"]["repo"])}))
        wt = Path(st["worktree"])
        head = gout("rev-parse", "HEAD", cwd=wt)
        branch = f"{REF_NS}/{stack.name}/{ref_label(st['onto'])}"
        git("update-ref", branch, head, cwd=base.repo)
        records = []
        for r in st["results"]:
            if r["outcome"] in RECORDS:
                records.append({"file": r["file"], "kind": r["outcome"],
                                "base": st["onto"], "reason": r["reason"]})
        text = rewrite_series(self.series, stack, new_pins(stack, base), records)
        for f, staged in st["staged"].items():
            data = Path(staged).read_bytes()
            if data != (self.series.patches_dir / f).read_bytes():
                atomic_write(self.series.patches_dir / f, data)
        atomic_write(self.series.path, text.encode())
        print(f"rebased stack '{stack.name}' onto {st['onto']} "
              f"({base.commit[:12]}): branch {branch}")
        for r in st["results"]:
            why = f"  ({r['reason']})" if r.get("reason") else ""
            print(f"  {r['file']:<60} {r['outcome']}{why}")
        if not st["staged"]:
            print("\n(no patch of the stack is left to compare)")
        elif st.get("old_head"):
            rd = git("range-diff", "--no-color",
                     f"{st['old_base']}..{st['old_head']}", f"{base.commit}..{head}",
                     cwd=base.repo, check=False)
            print("\nrange-diff (old series vs new):")
            print(rd.stdout.decode(errors="replace").rstrip() or "  (no changes)")
        else:
            print("\n(range-diff skipped: the old base is not in this repository)")
        self.discard()
        return 0


def cmd_rebase(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    rb = Rebase(series, args)
    for how in ("continue", "skip", "abort"):
        if getattr(args, how):
            return rb.resume(how)
    stack = series.stack(args.stack)
    user_repo = find_user_repo(args.repo)
    onto = args.onto
    if args.time_machine:
        onto = time_machine(series, stack, args.time_machine, user_repo, args)
        if onto is None:
            return 1
        if args.dry_run:
            return 0
    if not onto:
        raise UserError("give --onto REV (or --time-machine A..B, --continue, "
                        "--skip, --abort)")
    return rb.start(stack, onto, user_repo)


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def list_releases(lo: str, hi: str, user_repo: Path | None,
                  offline: bool) -> list[str]:
    """Final releases lo..hi (inclusive), oldest first, as vX.Y.Z: those the
    package index lists (unless offline) and those tagged in the repos."""
    found: set[str] = set()
    if not offline:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions",
                               "vllm", "--disable-pip-version-check"],
                              capture_output=True, text=True)
        m = re.search(r"Available versions: (.*)", proc.stdout)
        if m:
            found |= {v.strip() for v in m.group(1).split(",")}
    for repo in (user_repo, cache_dir() / "vllm.git"):
        if repo is not None and repo.exists():
            found |= {t[1:] for t in gout("tag", "--list", "v*", cwd=repo,
                                          check=False).split()}
    want = [v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v)
            and version_key(lo) <= version_key(v) <= version_key(hi)]
    if not want:
        raise UserError(f"no vLLM release between {lo} and {hi} (pip index "
                        "unreachable and none cached?)")
    return [f"v{v}" for v in sorted(want, key=version_key)]


def parse_range(text: str, user_repo: Path | None, offline: bool) -> list[str]:
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise UserError(f"range '{text}' is not A..B")
    if RELEASE_TAG.match(lo) and RELEASE_TAG.match(hi):
        return list_releases(lo.lstrip("v"), hi.lstrip("v"), user_repo, offline)
    if user_repo is None:
        raise UserError("a commit range needs --repo (release ranges vA..vB "
                        "work without one)")
    commits = gout("rev-list", "--first-parent", "--reverse", f"{lo}..{hi}",
                   cwd=user_repo, check=False).split()
    if not commits:
        raise UserError(f"empty or unknown range '{text}' in {user_repo}")
    return commits


def try_apply(series: Series, stack: Stack, rev: str, user_repo: Path | None,
              args: argparse.Namespace, key: str
              ) -> tuple[Base | None, dict[str, PatchResult], str]:
    try:
        base = resolve_base(stack, rev, user_repo, args.offline)
    except BaseUnavailable as e:
        return None, {}, e.reason
    patches = [load_patch(series, p) for p in stack.patches]
    res = {p.file: PatchResult(p.file) for p in patches}
    wt = worktree(base.repo, f"{stack.name}-{key}", base.commit)
    apply_stack(wt, patches, res)
    return base, res, ""


def time_machine(series: Series, stack: Stack, rng: str, user_repo: Path | None,
                 args: argparse.Namespace) -> str | None:
    """The newest base in the range where every patch applies (gbp pq's
    --time-machine): tried newest first, apply only."""
    for rev in reversed(parse_range(rng, user_repo, args.offline)):
        base, res, why = try_apply(series, stack, rev, user_repo, args, "tm")
        if base is None:
            print(f"  {rev}: base unavailable ({why})")
            continue
        bad = [f for f, r in res.items() if r.apply not in ("clean", "3way")]
        print(f"  {rev}: " + ("all patches apply" if not bad else
                              f"{len(bad)} do not apply ({', '.join(bad)})"))
        if not bad:
            print(f"time machine: newest base where the stack applies: {rev}")
            return rev
    print(f"time machine: no base in {rng} where every patch of '{stack.name}' "
          "applies")
    return None


def cmd_status(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    stack = series.stack(args.stack)
    user_repo = find_user_repo(args.repo)
    if bool(args.bases) == bool(args.releases):
        raise UserError("give one of --bases A,B,... or --releases A..B")
    revs = (args.bases.split(",") if args.bases
            else parse_range(args.releases, user_repo, args.offline))
    patches = [load_patch(series, p) for p in stack.patches]
    python = test_python(args.python)
    columns = []
    for rev in revs:
        say(f"apply.py status: {stack.name} on {rev}")
        base, res, why = try_apply(series, stack, rev, user_repo, args, "status")
        col = {"base": rev, "cells": {}}
        if base is None:
            col["unavailable"] = why
            columns.append(col)
            continue
        col.update(commit=base.commit, upstream_commit=base.upstream_commit)
        base_wt = worktree(base.repo, f"{stack.name}-status-base", base.commit)
        ids = list(dict.fromkeys(t for p in patches for t in p.regression))
        out, _ = run_tests(series.root, base_wt, ids, python, f"{rev}, base")
        for p in patches:
            reg = aggregate([out[t][0] for t in p.regression], True)
            cell = res[p.file].apply
            if cell == "conflict" and reg == "pass":
                cell = "not-needed"
            col["cells"][p.file] = {"apply": cell, "regression_base": reg}
        columns.append(col)
    rows = [["patch"] + [c["base"] for c in columns]]
    for p in patches:
        row = [p.file]
        for c in columns:
            if "unavailable" in c:
                row.append("unavailable")
                continue
            cell = c["cells"][p.file]
            mark = "*" if cell["apply"] in ("clean", "3way") and \
                cell["regression_base"] == "pass" else ""
            row.append(cell["apply"] + mark)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("* applies, but its regression tests already pass on that base")
    report = {"stack": stack.name, "date": time.strftime("%Y-%m-%d"),
              "columns": columns}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return 0


def add_rebase_commands(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    r = sub.add_parser(
        "rebase", formatter_class=fmt, help="carry a stack to a new base",
        description="Rebase a stack onto a new base: keep (and refresh) each "
        "patch that applies, mark 'not-needed' the ones that do not apply and "
        "whose regression tests pass without them, stop at real conflicts. "
        "series and patches/ change only when the whole rebase succeeds.",
        epilog="examples:\n  python apply.py rebase --onto v0.21.0\n"
        "  python apply.py rebase --continue    # after resolving a conflict\n"
        "  python apply.py rebase --time-machine v0.20.2..v0.26.0 --dry-run")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--onto", help="the new base (tag, commit, release)")
    g.add_argument("--continue", action="store_true", dest="continue",
                   help="go on after resolving a conflict")
    g.add_argument("--skip", action="store_true",
                   help="drop the conflicting patch and go on")
    g.add_argument("--abort", action="store_true",
                   help="stop; series and patches stay as they were")
    g.add_argument("--time-machine", metavar="A..B",
                   help="rebase onto the newest base in A..B where all apply")
    r.add_argument("--dry-run", action="store_true",
                   help="with --time-machine: only find the base")
    r.set_defaults(func=cmd_rebase)
    common(r, "stack", "repo", "python", "offline")

    s = sub.add_parser(
        "status", formatter_class=fmt, help="patch x base matrix, measured",
        description="For each base, apply the stack and run the regression "
        "tests on the unpatched base: clean / 3way / conflict / not-needed per "
        "patch, every cell measured.",
        epilog="examples:\n  python apply.py status --bases v0.20.2,v0.21.0\n"
        "  python apply.py status --releases v0.20.0..v0.33.0 --json m.json")
    s.add_argument("--bases", help="comma-separated revisions")
    s.add_argument("--releases", metavar="A..B", help="every release in A..B")
    s.add_argument("--json", help="write the matrix here")
    s.set_defaults(func=cmd_status)
    common(s, "stack", "repo", "python", "offline")


# --------------------------------------------------------------------------
# deliver: patched wheel, PR branches


# What a patched wheel cannot carry: the sources of compiled extensions.
COMPILED_SOURCE = re.compile(
    r"^(?:csrc|cmake)/|(?:^|/)CMakeLists\.txt$|^setup\.py$"
    r"|\.(?:cu|cuh|c|cc|cpp|cxx|h|hpp)$")
# PEP 427: {name}-{version}(-{build})?-{python}-{abi}-{platform}.whl
WHEEL_FILE = re.compile(
    r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(?:-(?P<build>\d[^-]*))?"
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")
# Written into the patched wheel's .dist-info: what it is made of.
WHEEL_MANIFEST = "vllm_patches.json"


def wheel_cli(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The `wheel` package's command line (unpack, pack), run by `python`.

    SOURCE_DATE_EPOCH (unless set) pins the archive's timestamps, so the same
    series on the same release wheel gives the same bytes.
    """
    env = dict(os.environ)
    env.setdefault("SOURCE_DATE_EPOCH", BASE_DATE.split()[0])
    try:
        return subprocess.run([python, "-m", "wheel", *args], capture_output=True,
                              text=True, env=env)
    except OSError as e:
        raise UserError(f"cannot run the Python '{python}': {e}") from None


def check_wheel_tool(python: str) -> None:
    proc = wheel_cli(python, "pack", "--help")
    if proc.returncode == 0 and "--local-version" in proc.stdout:
        return
    why = "is too old in" if proc.returncode == 0 else "is missing from"
    raise UserError(f"the 'wheel' package {why} {python} (need wheel>=0.48 for "
                    f"'wheel pack --local-version'): {python} -m pip install -U "
                    "'wheel>=0.48' (or name another Python with --python)")


def wheel_step(python: str, *args: str) -> None:
    proc = wheel_cli(python, *args)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"wheel {args[0]} failed: {last}")


def stack_release(stack: Stack, rev: str | None, base: Base) -> str | None:
    """The vLLM release a base is (X.Y.Z), if it is one."""
    for r in ([rev] if rev else [stack.pins.get("tag")]):
        if r and RELEASE_TAG.match(r):
            return RELEASE_TAG.match(r).group(1)
    msg = gout("log", "-1", "--format=%B", base.commit, cwd=base.repo)
    m = re.search(r"^Release: (\S+)$", msg, re.M)  # a materialized release
    return m.group(1) if m else None


def tree_changes(repo: Path, old: str, new: str) -> dict[str, str]:
    """{path: A | M | D} between two commits, renames as delete + add."""
    out = git("diff", "--name-status", "-z", "--no-renames", old, new,
              cwd=repo).stdout.decode().split("\0")
    changes = {}
    for status, path in zip(out[0::2], out[1::2]):
        changes[path] = "M" if status == "T" else status
    return changes


def tree_blobs(repo: Path, rev: str, paths: list[str]) -> dict[str, tuple[str, str]]:
    """{path: (mode, blob id)} of the given paths at `rev`."""
    if not paths:
        return {}
    out = git("ls-tree", "-r", "-z", rev, "--", *paths, cwd=repo).stdout.decode()
    blobs = {}
    for rec in out.split("\0"):
        if rec:
            meta, path = rec.split("\t", 1)
            mode, _, oid = meta.split()
            blobs[path] = (mode, oid)
    return blobs


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def set_version_py(path: Path, release: str, version: str, local: str) -> None:
    """vllm/_version.py (written by setuptools-scm) names the local version."""
    import ast

    text = path.read_text()
    m1 = re.search(r"^(__version__ = version = )(['\"])([^'\"]*)\2$", text, re.M)
    m2 = re.search(r"^(__version_tuple__ = version_tuple = )(\(.*\))$", text, re.M)
    if not m1 or not m2 or m1.group(3) != release:
        raise UserError(f"vllm/_version.py of the wheel does not read "
                        f"'__version__ = version = {release!r}' and "
                        "'__version_tuple__ = version_tuple = (...)'")
    old = ast.literal_eval(m2.group(2))
    text = (text[:m1.start()] + m1.group(1) + repr(version) + text[m1.end():])
    m2 = re.search(r"^(__version_tuple__ = version_tuple = )(\(.*\))$", text, re.M)
    text = (text[:m2.start()] + m2.group(1) + repr(tuple(old) + (local,))
            + text[m2.end():])
    path.write_text(text)


def set_wheel_tags(wheel_meta: Path, name: re.Match) -> None:
    """Tag: lines of .dist-info/WHEEL as the file name says.

    `wheel pack` names its output from these lines; vLLM's release wheels are
    renamed to manylinux_* after the build, so their WHEEL still says
    linux_x86_64. The output keeps the input's file-name tags.
    """
    tags = [f"{p}-{a}-{t}" for p in name["py"].split(".")
            for a in name["abi"].split(".") for t in name["plat"].split(".")]
    lines = wheel_meta.read_text().splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("Tag:")),
              len(lines))
    rest = [ln for ln in lines if not ln.startswith("Tag:")]
    rest[at:at] = [f"Tag: {t}" for t in tags]
    wheel_meta.write_text("\n".join(rest) + "\n")


def cmd_wheel(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    series = parse_series(Path(args.series))
    stack = series.stack(args.stack)
    patches = [load_patch(series, p) for p in stack.patches]
    if not patches:
        raise UserError(f"stack '{stack.name}' lists no patch")
    for p in patches:
        for f in p.files:
            if COMPILED_SOURCE.search(f):
                raise UserError(
                    f"patches/{p.file} changes {f}, a source of vLLM's compiled "
                    "extensions: a patched wheel cannot carry that without a "
                    "CUDA rebuild (build vLLM from the patched tree instead)")
    python = test_python(args.python)
    check_wheel_tool(python)
    user_repo = find_user_repo(args.repo)
    try:
        base = resolve_base(stack, args.base, user_repo, args.offline)
        release = stack_release(stack, args.base, base)
        if release is None:
            raise UserError(f"base '{base.rev}' is not a vLLM release: give "
                            "--base vX.Y.Z (the release the wheel is of)")
        src = (Path(args.from_wheel).expanduser().resolve() if args.from_wheel
               else release_wheel(release))
    except BaseUnavailable as e:
        raise UserError(f"{e.reason} (to get it: {e.hint})") from None
    if not src.is_file():
        raise UserError(f"{src}: no such wheel file")
    name = WHEEL_FILE.match(src.name)
    if not name or name["name"].lower() != "vllm":
        raise UserError(f"{src.name}: not a vLLM wheel file name "
                        "(vllm-VERSION-PY-ABI-PLATFORM.whl)")
    if name["ver"] != release:
        raise UserError(f"{src.name} is vLLM {name['ver']}, but the base "
                        f"{base.rev} is release {release}: give the official "
                        f"vllm {release} wheel (or --base v{name['ver']})")
    local = (re.sub(r"[-_.]+", ".", stack.name.lower()) + "."
             + series.digest(stack)[:8])
    version = f"{release}+{local}"

    results = {p.file: PatchResult(p.file) for p in patches}
    with locked(hashlib.sha1(str(git_common_dir(base.repo)).encode())
                .hexdigest()[:10]):
        wt = worktree(base.repo, f"{stack.name}-wheel", base.commit)
        conflicts = apply_stack(wt, patches, results)
        if conflicts:
            for p in conflicts:
                files = ", ".join(results[p.file].conflict_files) or "?"
                print(f"{p.file}: does not apply on {base.rev} (conflicts in "
                      f"{files})")
            say(f"apply.py wheel: {len(conflicts)} patch(es) do not apply on "
                f"{base.rev}; no wheel written")
            return 1
        head = gout("rev-parse", "HEAD", cwd=wt)
        changes = tree_changes(wt, base.commit, head)
        new = tree_blobs(wt, head, [p for p, s in changes.items() if s != "D"])
        old = tree_blobs(wt, base.commit, [p for p, s in changes.items()
                                           if s != "A"])
        data = {}
        for path, (mode, oid) in new.items():
            if mode not in ("100644", "100755"):
                raise UserError(f"the patched tree's {path} is not a regular "
                                f"file (mode {mode}); a wheel cannot carry it")
            data[path] = git("cat-file", "blob", oid, cwd=wt).stdout
    src_size = src.stat().st_size
    h = hashlib.sha256()
    with src.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    out_dir = Path(args.out).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"apply.py wheel: {src.name} + stack {stack.name} ({len(patches)} "
        f"patch(es), {len(changes)} file(s)) -> {version}")
    timings = {}
    notes = []
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".apply-wheel-") as tmp:
        t0 = time.monotonic()
        wheel_step(python, "unpack", "--dest", str(Path(tmp) / "in"), str(src))
        timings["unpack"] = time.monotonic() - t0
        root = next((Path(tmp) / "in").iterdir())
        infos = [d for d in root.iterdir() if d.name.endswith(".dist-info")]
        if len(infos) != 1:
            raise UserError(f"{src.name}: expected one .dist-info directory")
        tops = {d.name for d in root.iterdir()} - {infos[0].name}
        shipped = {}
        for path, status in sorted(changes.items()):
            if PurePosixPath(path).parts[0] not in tops:
                notes.append(f"not in the wheel (not shipped): {path}")
                continue
            target = root / path
            if status in ("M", "D"):
                if not target.is_file():
                    notes.append(f"the official wheel lacks {path} ({status})")
                elif git_blob_id(target.read_bytes()) != old[path][1]:
                    notes.append(f"warning: {path} in the official wheel differs "
                                 f"from base {base.rev}'s")
            if status == "D":
                target.unlink(missing_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[path])
                target.chmod(0o755 if new[path][0] == "100755" else 0o644)
            shipped[path] = status
        set_version_py(root / "vllm" / "_version.py", release, version, local)
        set_wheel_tags(infos[0] / "WHEEL", name)
        manifest = {
            "tool": "apply.py wheel", "version": version, "release": release,
            "stack": stack.name, "series_sha256": series.digest(stack),
            "base": {"rev": base.rev, "commit": base.commit,
                     "upstream_commit": base.upstream_commit},
            "from_wheel": {"file": src.name, "sha256": h.hexdigest()},
            "patches": [{"file": p.file, "subject": p.subject,
                         "upstream_status": (p.values("Upstream-Status") or
                                             [""])[0]} for p in patches],
            "files": shipped,
        }
        (infos[0] / WHEEL_MANIFEST).write_text(json.dumps(manifest, indent=2)
                                               + "\n")
        t0 = time.monotonic()
        pack = ["pack", "--dest-dir", str(Path(tmp) / "out"),
                "--local-version", local]
        if name["build"]:
            pack += ["--build-number", name["build"]]
        (Path(tmp) / "out").mkdir()
        wheel_step(python, *pack, str(root))
        timings["pack"] = time.monotonic() - t0
        built = list((Path(tmp) / "out").glob("*.whl"))
        build = f"-{name['build']}" if name["build"] else ""
        want = (f"vllm-{version}{build}-{name['py']}-{name['abi']}-"
                f"{name['plat']}.whl")
        if len(built) != 1 or built[0].name != want:
            raise UserError(f"wheel pack wrote {[b.name for b in built]}, "
                            f"expected {want}")
        out = out_dir / want
        os.replace(built[0], out)
    seconds = time.monotonic() - t_start
    size = out.stat().st_size
    delta = size - src_size
    print(out)
    print(f"  vllm {version}: stack {stack.name} ({len(patches)} patch(es)) on "
          f"{base.rev} ({base.commit[:12]}), from {src.name}")
    for path, status in shipped.items():
        print(f"    {status} {path}")
    for n in notes:
        print(f"  {n}")
    print(f"  built in {seconds:.1f} s (wheel unpack {timings['unpack']:.1f} s, "
          f"wheel pack {timings['pack']:.1f} s); size {src_size} -> {size} "
          f"bytes ({delta:+d} B, {100 * delta / src_size:+.4f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"wheel": str(out), "version": version, "from_wheel": str(src),
             "seconds": round(seconds, 2),
             "unpack_seconds": round(timings["unpack"], 2),
             "pack_seconds": round(timings["pack"], 2),
             "size": size, "from_size": src_size, "size_delta": delta,
             "files": shipped, "notes": notes, "manifest": manifest},
            indent=2) + "\n")
    return 0


# ---- export: one upstream PR branch per patch

VLLM_ISSUE = re.compile(r"^https://github\.com/vllm-project/vllm/issues/(\d+)/?$")
PR_DROP_TRAILERS = {"bug", "upstream-status", "tests"}
# Subject component -> vLLM's test directory for it.
COMPONENT_TESTS = {"attention": "tests/v1/attention",
                   "turboquant": "tests/v1/attention",
                   "kernel": "tests/kernels", "quantization": "tests/quantization"}

# The pieces of tests/patches/conftest.py an exported test module may need,
# written for vLLM's own test tree (vllm imported directly, no VLLM_TREE).
EXPORT_HARNESS = {
    "env": '''\
if not _torch.cuda.is_available():
    # CPU-only host: run Triton kernels in Triton's interpreter.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
''',
    "VLLM_TREE": '''\
# The directory holding the vllm package under test.
os.environ.setdefault(
    "VLLM_TREE",
    str(Path(importlib.util.find_spec("vllm").origin).resolve().parents[1]),
)
''',
    "gpu": '''\
_needs_gpu = pytest.mark.skipif(
    not _torch.cuda.is_available(), reason="needs a CUDA GPU"
)
''',
    "vllm_tree": '''\
@pytest.fixture(scope="session")
def vllm_tree() -> Path:
    """The directory holding the vllm package under test."""
    import vllm

    return Path(vllm.__file__).resolve().parents[1]
''',
    "device": '''\
@pytest.fixture
def device() -> "_torch.device":
    return _torch.device("cuda" if _torch.cuda.is_available() else "cpu")
''',
    "_accelerator_empty_cache_noop": '''\
@pytest.fixture(autouse=True)
def _accelerator_empty_cache_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    # WorkspaceManager calls torch.accelerator.empty_cache(), which raises on
    # a CPU-only torch.
    if _torch.accelerator.current_accelerator() is None:
        monkeypatch.setattr(_torch.accelerator, "empty_cache", lambda: None)
''',
    "cpu_platform": '''\
@pytest.fixture
def cpu_platform(vllm_tree: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM's CpuPlatform as current_platform on a CPU-only host."""
    import vllm.platforms as platforms

    if _torch.cuda.is_available():
        return platforms.current_platform
    from vllm.platforms.cpu import CpuPlatform

    plat = CpuPlatform()
    monkeypatch.setattr(platforms, "_current_platform", plat)
    return plat
''',
}


def pick_patch(series: Series, want: str) -> tuple[Stack, str]:
    found = [(s, e) for s in series.stacks for e in s.patches
             if e.startswith(want) or Path(e).name.startswith(want)]
    if len(found) != 1:
        what = "no patch" if not found else f"{len(found)} patches"
        raise UserError(f"'{want}': {what} of the series match (give the file "
                        "name, e.g. tq/0001-....patch, or a unique prefix)")
    return found[0]


def fixture_names(conftest: Path) -> set[str]:
    import ast

    if not conftest.is_file():
        return set()
    names = set()
    for node in ast.parse(conftest.read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list):
            names.add(node.name)
    return names


def adapt_test_module(src: Path, rel: str) -> tuple[str, list[str]]:
    """The series' test module, made to run in vLLM's own test tree.

    The series runs it against the tree named by VLLM_TREE with the fixtures
    of its conftest.py; in vLLM's tree vllm is imported directly, and the
    harness pieces the module uses are defined in it, after its imports.
    Returns the new text and what was adapted, in words.
    """
    import ast

    text = src.read_text()
    mod = ast.parse(text)
    used = {a.arg for n in ast.walk(mod)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs}
    bound = set()
    for n in mod.body:
        if isinstance(n, ast.Import):
            bound |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            bound |= {a.asname or a.name for a in n.names}
    uses_torch = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch"
                                           for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0]
            == "torch") for n in ast.walk(mod))
    done = []
    if re.search(r"\bpytest\.mark\.gpu\b", text):
        text = re.sub(r"\bpytest\.mark\.gpu\b", "_needs_gpu", text)
        done.append("pytest.mark.gpu became a skipif(no CUDA) mark")
        want = ["gpu"]
    else:
        want = []
    if uses_torch or want or used & {"device", "cpu_platform"}:
        want.insert(0, "env")
        done.append('on a CPU-only host CUDA_VISIBLE_DEVICES="" and '
                    "TRITON_INTERPRET=1 are set unless set")
    if "VLLM_TREE" in text:
        want.append("VLLM_TREE")
        done.append("VLLM_TREE defaults to the directory holding the imported "
                    "vllm package")
    if "cpu_platform" in used:
        used.add("vllm_tree")
    fixtures = [f for f in ("vllm_tree", "device", "cpu_platform") if f in used]
    if fixtures:
        done.append(f"fixture(s) {', '.join(fixtures)} defined in the module "
                    "(from the series' conftest.py)")
    want += fixtures
    if uses_torch:
        want.append("_accelerator_empty_cache_noop")
        done.append("torch.accelerator.empty_cache() is a no-op where there is "
                    "no accelerator (autouse fixture, as in the series)")
    missing = sorted(fixture_names(src.parent / "conftest.py") & used
                     - set(EXPORT_HARNESS))
    if missing:
        say(f"apply.py export: warning: {rel} uses fixture(s) "
            f"{', '.join(missing)} of the series' conftest.py, not provided "
            "in vLLM's tree")
        done.append(f"NOT provided: fixture(s) {', '.join(missing)}")
    # after the docstring, __future__ imports and the module's own imports
    at = 0
    for i, node in enumerate(mod.body):
        doc = (i == 0 and isinstance(node, ast.Expr)
               and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str))
        if not (doc or isinstance(node, (ast.Import, ast.ImportFrom))):
            break
        at = node.end_lineno
    lines = text.splitlines(keepends=True)
    import textwrap

    note = textwrap.fill(
        f"Adapted from the vllm-patches series ({rel}), which runs it against "
        "a source tree with the harness of its conftest.py: here vllm is "
        "imported directly" + (", and the harness pieces used below are "
                               "defined in this module." if want else "."),
        78, initial_indent="# ", subsequent_indent="# ")
    pre = ["\n" + note + "\n"]
    if want:
        needs = {"importlib": "VLLM_TREE" in want,
                 "os": bool({"env", "VLLM_TREE"} & set(want)),
                 "Path": bool({"VLLM_TREE", "vllm_tree", "cpu_platform"}
                              & set(want)),
                 "pytest": bool(set(want) - {"env", "VLLM_TREE"})}
        imports = {"importlib": "import importlib.util\n", "os": "import os\n",
                   "Path": "from pathlib import Path\n",
                   "pytest": "import pytest\n"}
        add = [imports[k] for k, need in needs.items() if need and not (
            k in bound if k != "importlib" else "importlib.util" in bound)]
        if set(want) - {"VLLM_TREE"} and "torch" not in bound:
            add.append("import torch as _torch\n")
        pre.insert(0, "".join(add))  # with the module's own imports
        for w in want:
            sep = "\n\n" if w in ("vllm_tree", "device", "cpu_platform",
                                   "_accelerator_empty_cache_noop") else "\n"
            piece = EXPORT_HARNESS[w]
            if "torch" in bound:  # the module's own `import torch`
                piece = re.sub(r"\b_torch\b", "torch", piece)
            pre.append(sep + piece)
        pre.append("\n\n# " + "-" * 74 + "\n")
    new = "".join(lines[:at]) + "".join(pre) + "".join(lines[at:])
    if not new.startswith(SPDX[0]):
        new = "\n".join(SPDX) + "\n" + ("" if new.startswith("\n") else "\n") \
            + new
        done.append("vLLM's SPDX header added")
    return new, done


def helper_paths(src: Path) -> list[Path]:
    """Sibling modules and packages of a test module that it names."""
    text = src.read_text()
    out = []
    for p in sorted(src.parent.iterdir()):
        stem = p.stem if p.suffix == ".py" else p.name
        if (p.name in ("conftest.py", "__init__.py", "__pycache__")
                or p.name.startswith(("test_", ".")) or p == src
                or not (p.is_dir() or p.suffix == ".py")):
            continue
        n = re.escape(stem)
        if re.search(rf"\bimport\s+{n}\b|\bfrom\s+{n}\b|['\"]{n}['\"]", text):
            out.append(p)
    return out


def vllm_test_dir(repo: Path, rev: str, patch: Patch) -> str:
    """Where vLLM keeps the tests of what a patch changes.

    By the subject's component ([Attention][TurboQuant] ...) where vLLM has
    a test directory for it; else by the code the patch changes most: vLLM
    mirrors its package in tests/ (vllm/model_executor/... is tested in
    tests/model_executor/), the deepest such directory the base has, else
    the first two levels (a release base made from a wheel has no tests/).
    """
    for comp in re.findall(r"\[([^\]]+)\]", patch.subject.split("] ")[0] + "]"):
        if comp.lower() in COMPONENT_TESTS:
            return COMPONENT_TESTS[comp.lower()]
    weight: dict[str, int] = {}
    for block in re.split(rb"(?m)^(?=diff --git )", patch.raw):
        m = DIFF_GIT.match(block)
        if not m or b"\ndeleted file mode " in block.split(b"\n@@", 1)[0]:
            continue
        path = m.group(2).decode()
        if path.startswith("vllm/") and path.endswith(".py"):
            weight[path] = sum(1 for ln in block.split(b"\n")[1:]
                               if ln[:1] in (b"+", b"-")
                               and not ln.startswith((b"+++ ", b"--- ")))
    if not weight:
        return "tests"
    parts = PurePosixPath(max(weight, key=weight.__getitem__)).parts[1:-1]
    for k in range(len(parts), 0, -1):
        d = "tests/" + "/".join(parts[:k])
        if git("cat-file", "-e", f"{rev}:{d}", cwd=repo,
               check=False).returncode == 0:
            return d
    return "tests/" + "/".join(parts[:2]) if parts else "tests"


def git_identity(repo: Path) -> tuple[str, str] | None:
    name = git("config", "user.name", cwd=repo, check=False).stdout.decode()
    email = git("config", "user.email", cwd=repo, check=False).stdout.decode()
    if name.strip() and email.strip():
        return name.strip(), email.strip()
    return None


def split_trailers(msg: str) -> tuple[str, list[tuple[str, str]]]:
    """A commit message's text before its trailer block, and the trailers."""
    paras = msg.strip().split("\n\n")
    last = paras[-1].splitlines()
    if len(paras) > 1 and last and all(
            re.match(r"^[A-Za-z0-9][A-Za-z0-9-]*: ", ln) for ln in last):
        return "\n\n".join(paras[:-1]), [
            (k.strip(), v.strip()) for k, _, v in
            (ln.partition(":") for ln in last)]
    return msg.strip(), []


def pr_message(patch: Patch, msg: str, tests: list[tuple[str, str, list[str]]],
               node_ids: list[str], result: str | None,
               signoff: tuple[str, str], needs: list[Patch],
               renames: dict[str, str]) -> tuple[str, str, list[str]]:
    """The commit message and PR body in vLLM's PR template.

    The patch message's own sections (a "Purpose" / "## Purpose" paragraph
    and the like) are sorted into the template's: Purpose (with Fix and other
    sections as its subsections), Test Plan (the carried test's command
    first, then the patch's own plan with the series' paths replaced by the
    exported ones), Test Result (the patch's, and ours when run). "When to
    drop" is about the series only and is left out. Returns the message,
    the body and the titles of the sections left out.
    """
    text, trailers = split_trailers(msg)
    subject, _, body = text.partition("\n")
    purpose, plan_own, result_own, dropped = [], [], [], []
    for title, part in message_sections(body):
        key = (title or "purpose").lower()
        if key == "purpose":
            purpose.append(part)
        elif key.startswith("test plan") or key in ("testing", "tests"):
            plan_own.append(part)
        elif key.startswith("test result"):
            result_own.append(part)
        elif key == "when to drop":
            dropped.append(title)
        else:
            purpose.append(f"### {title}\n\n{part}")
    links = []
    for b in patch.values("Bug"):
        m = VLLM_ISSUE.match(b)
        links.append(f"FIX #{m.group(1)}" if m else f"Related: {b}")
    if needs:
        links += ["", "This change applies on top of (to be merged first):"]
        links += [f"- {p.subject}" for p in needs]
    plan = ["Regression tests added with this change (they fail before it "
            "and pass with it):", "", "```bash",
            "pytest -v " + " \\\n    ".join(map(shlex.quote, node_ids)), "```"]
    for dst, src, done in tests:
        plan += ["", f"`{dst}` comes from the vllm-patches series (`{src}`), "
                 "adapted to vLLM's test tree: "
                 + ("; ".join(done) if done else "copied unchanged") + "."]
    for part in plan_own:
        for old in sorted(renames, key=len, reverse=True):
            part = part.replace(old, renames[old])
        plan += ["", re.sub(r"\bVLLM_TREE=\S+\s+", "", part)]
    if result is None:
        result = "" if result_own else (
            "Not run by `apply.py export` (give --run-tests, or paste the Test "
            "Plan's output before and after this change).")
    kept = [(k, v) for k, v in trailers if k.lower() not in PR_DROP_TRAILERS]
    sob = f"{signoff[0]} <{signoff[1]}>"
    if ("Signed-off-by", sob) not in kept:
        kept.append(("Signed-off-by", sob))
    pr_body = re.sub(r"\n{3,}", "\n\n", "\n".join([
        "## Purpose", "", "\n\n".join(purpose), "", *links, "",
        "## Test Plan", "", *plan, "", "## Test Result", "",
        "\n\n".join(result_own), "", result.strip()]))
    pr_body = pr_body.strip()
    message = (subject.strip() + "\n\n" + pr_body + "\n\n" +
               "\n".join(f"{k}: {v}" for k, v in kept) + "\n")
    return message, pr_body + "\n", dropped


SECTION_TITLES = {"purpose", "fix", "why", "how", "test plan", "test result",
                  "test results", "testing", "tests", "when to drop",
                  "related pr", "future plan"}


def message_sections(body: str) -> list[tuple[str | None, str]]:
    """(title, text) of a commit message body's sections, in order.

    A section starts at a Markdown heading (`## Fix`) or at a known title
    alone on its line between blank lines (`Test Plan`); text before any is
    titled None. Fenced code blocks are never split.
    """
    lines = body.strip("\n").splitlines()
    out: list[tuple[str | None, list[str]]] = [(None, [])]
    fence = False
    for i, ln in enumerate(lines):
        if ln.startswith("```"):
            fence = not fence
        title = None
        if not fence:
            m = re.match(r"^#{1,4} +(\S.*?)[ #]*$", ln)
            alone = ((i == 0 or not lines[i - 1].strip()) and
                     (i + 1 == len(lines) or not lines[i + 1].strip()))
            if m:
                title = m.group(1)
            elif alone and ln.strip().rstrip(":").lower() in SECTION_TITLES:
                title = ln.strip().rstrip(":")
        if title:
            out.append((title, []))
        else:
            out[-1][1].append(ln)
    return [(t, "\n".join(ls).strip()) for t, ls in out
            if t or "\n".join(ls).strip()]


def export_ref(repo: Path, name: str, force: bool) -> str:
    if git("check-ref-format", "--branch", name, cwd=repo,
           check=False).returncode != 0:
        raise UserError(f"'{name}' is not a valid branch name")
    ref = f"refs/heads/{name}"
    for ln in gout("worktree", "list", "--porcelain", cwd=repo).splitlines():
        if ln == f"branch {ref}":
            raise UserError(f"branch '{name}' is checked out in a worktree of "
                            f"{repo}; pick another --branch")
    if (not ref.startswith(REF_NS + "/") and rev_commit(repo, ref)
            and not force):
        raise UserError(f"branch '{name}' exists and is not the tool's (not "
                        f"under {REF_NS[len('refs/heads/'):]}/): pick another "
                        "--branch, or --force to overwrite it")
    return ref


def cmd_export(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    stack, entry = pick_patch(series, args.patch)
    patches = [load_patch(series, e) for e in stack.patches]
    idx = stack.patches.index(entry)
    patch = patches[idx]
    if not patch.regression:
        raise UserError(f"patches/{entry}: no 'Tests:' trailer, so no "
                        "regression test to carry in the PR")
    test_files = list(dict.fromkeys(t.split("::", 1)[0] for t in patch.regression))
    for f in test_files:
        check_safe_relpath(f, f"patches/{entry}: test")
        if not (series.root / f).is_file():
            raise UserError(f"patches/{entry}: test file {f} does not exist")
    user_repo = find_user_repo(args.repo)
    base = None
    pin = stack.file_pins.get(entry)
    if pin and not args.base:  # the patch's own base ('#@ pin'), when at hand
        try:
            base = resolve_base(dataclasses.replace(stack, pins=pin,
                                                    file_pins={}),
                                None, user_repo, args.offline)
        except BaseUnavailable as e:
            say(f"apply.py export: {entry}'s own pin {pin['commit'][:12]} is "
                f"not at hand ({e.reason}): using the stack's base")
    try:
        base = base or resolve_base(stack, args.base, user_repo, args.offline)
    except BaseUnavailable as e:
        raise UserError(f"base unavailable: {e.reason} (to get it: {e.hint})") \
            from None
    stem = Path(entry).stem
    branch = args.branch or f"{REF_NS[len('refs/heads/'):]}/pr/{stem}"
    ref = export_ref(base.repo, branch, args.force)
    ident = git_identity(base.repo)
    signoff = ident or IDENTITY
    python = test_python(args.python)
    rid = hashlib.sha1(str(git_common_dir(base.repo)).encode()).hexdigest()[:10]
    with locked(rid):
        key = f"{stack.name}-export"
        wt = worktree(base.repo, key, base.commit)
        results = {p.file: PatchResult(p.file) for p in patches[:idx + 1]}
        needs: list[Patch] = []
        if apply_stack(wt, [patch], results):
            wt = worktree(base.repo, key, base.commit)
            results = {p.file: PatchResult(p.file) for p in patches[:idx + 1]}
            conflicts = apply_stack(wt, patches[:idx + 1], results)
            if patch in conflicts:
                print(f"{entry}: does not apply on {base.rev}, alone or after "
                      "the patches before it (conflicts in "
                      f"{', '.join(results[entry].conflict_files) or '?'})")
                return 1
            needs = [p for p in patches[:idx]
                     if results[p.file].apply in ("clean", "3way")]
        am_commit = gout("rev-parse", "HEAD", cwd=wt)
        parent = gout("rev-parse", "HEAD~1", cwd=wt)
        dest = args.test_dir or vllm_test_dir(wt, am_commit, patch)
        check_safe_relpath(dest, "--test-dir")
        placed: list[tuple[str, str, list[str]]] = []
        renamed: dict[str, str] = {}
        renames: dict[str, str] = {}  # series paths -> vLLM tree paths
        for f in test_files:
            src = series.root / f
            name = src.name
            if git("cat-file", "-e", f"{am_commit}:{dest}/{name}", cwd=wt,
                   check=False).returncode == 0:
                name = f"{src.stem}_regression.py"
            text, done = adapt_test_module(src, f)
            target = wt / dest / name
            if target.exists():
                raise UserError(f"{dest}/{name} already exists in the tree: "
                                "give --test-dir")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            added = [f"{dest}/{name}"]
            for h in helper_paths(src):
                files = [h] if h.is_file() else sorted(
                    x for x in h.rglob("*") if x.is_file() and
                    "__pycache__" not in x.parts and x.suffix != ".pyc")
                for x in files:
                    rel = x.relative_to(src.parent).as_posix()
                    (wt / dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(x, wt / dest / rel)
                    added.append(f"{dest}/{rel}")
                done.append(f"helper {h.name} copied alongside")
                renames[(PurePosixPath(f).parent / h.name).as_posix()] = \
                    f"{dest}/{h.name}"
            git("add", "-f", "--", *added, cwd=wt)
            placed.append((f"{dest}/{name}", f, done))
            renamed[f] = renames[f] = f"{dest}/{name}"
        node_ids = [renamed[t.split("::", 1)[0]] + t[len(t.split("::", 1)[0]):]
                    for t in patch.regression]
        result = None
        if args.run_tests:
            result = export_test_result(series, base, patch, parent, am_commit,
                                        stack, python)
        msg = gout("log", "-1", "--format=%B", am_commit, cwd=wt)
        message, body, dropped = pr_message(patch, msg, placed, node_ids, result,
                                            signoff, needs, renames)
        tree = gout("write-tree", cwd=wt)
        who = gout("log", "-1", "--format=%an%x00%ae%x00%ad", "--date=raw",
                   am_commit, cwd=wt).split("\0")
        env = {"GIT_AUTHOR_NAME": who[0], "GIT_AUTHOR_EMAIL": who[1],
               "GIT_AUTHOR_DATE": who[2], "GIT_COMMITTER_NAME": signoff[0],
               "GIT_COMMITTER_EMAIL": signoff[1], "GIT_COMMITTER_DATE": who[2]}
        commit = gout("commit-tree", tree, "-p", parent, cwd=wt, env=env,
                      input=message.encode())
        git("update-ref", "-m", f"apply.py export {entry}", ref, commit,
            cwd=base.repo)
    out_dir = cache_dir() / "export"
    out_dir.mkdir(parents=True, exist_ok=True)
    body_file = out_dir / f"{stem}.md"
    body_file.write_text(body)
    patch_file = out_dir / f"{stem}.patch"  # the commit, exported as the series'
    patch_file.write_bytes(format_patch(base.repo, commit))
    subject = patch.subject
    remote_branch = branch.split("/", 1)[1] if branch.startswith(
        REF_NS[len("refs/heads/"):] + "/") else branch
    on = (f"{base.rev} ({base.commit[:12]})" if not needs else
          f"{needs[-1].file} ({parent[:12]}) on {base.rev}")
    print(f"{ref} in {base.repo}")
    print(f"  {commit[:12]} {subject}")
    print(f"  parent: {on}")
    if needs:
        print(f"  note: {entry} does not apply on {base.rev} alone; the branch "
              f"is based on the patches before it: "
              f"{', '.join(p.file for p in needs)} (open those PRs first, or "
              "say in this one that it depends on them)")
    for dst, src, done in placed:
        print(f"  test: {dst} (from {src}; " + ("; ".join(done) or "unchanged")
              + ")")
    if dropped:
        print(f"  left out of the PR message (about the series only): "
              f"{', '.join(dropped)}")
    print(f"  signed off by: {signoff[0]} <{signoff[1]}>"
          + ("" if ident else " (no git identity configured: the project's)"))
    print(f"  PR description: {body_file}")
    print(f"  as a patch file: {patch_file}")
    if base.source in ("cache", "pypi") and re.search(
            r"^Release: ", gout("log", "-1", "--format=%B", base.commit,
                                cwd=base.repo), re.M):
        print(f"  note: {base.repo} is the tool's cache: its {base.rev} is the "
              "release's Python sources (from the wheel), not vLLM's history. "
              "To open the PR, export in a vLLM clone "
              f"(apply.py export {stem} --repo ~/src/vllm), or carry the "
              f"commit to a branch at {base.rev} there: git -C ~/src/vllm am -k "
              f"{patch_file}")
    print("to open the PR (vLLM takes PRs against main: rebase the branch there "
          "first if its base is a release):")
    print(f"  git -C {shlex.quote(str(base.repo))} push YOUR_FORK_REMOTE "
          f"{ref}:refs/heads/{remote_branch}")
    print(f"  gh pr create --repo vllm-project/vllm --base main --head "
          f"YOUR_GITHUB_USER:{remote_branch} --title {shlex.quote(subject)} "
          f"--body-file {shlex.quote(str(body_file))}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"patch": entry, "ref": ref, "repo": str(base.repo), "commit": commit,
             "parent": parent, "base": base.rev, "base_commit": base.commit,
             "needs": [p.file for p in needs],
             "tests": [{"file": d, "from": s, "adapted": a} for d, s, a in placed],
             "body_file": str(body_file), "patch_file": str(patch_file)},
            indent=2) + "\n")
    return 0


def export_test_result(series: Series, base: Base, patch: Patch, parent: str,
                       patched: str, stack: Stack, python: str) -> str:
    """The regression tests run (series harness) before and with the change."""
    before_wt = worktree(base.repo, f"{stack.name}-export-base", parent)
    ids = patch.regression
    before, _ = run_tests(series.root, before_wt, ids, python, "export, before")
    after_wt = worktree(base.repo, f"{stack.name}-export-after", patched)
    after, _ = run_tests(series.root, after_wt, ids, python, "export, with it")
    rows = [f"| `{t}` | {before[t][0]} | {after[t][0]} |" for t in ids]
    return "\n".join([
        "Run by `apply.py export --run-tests` with the series' harness "
        f"(`{ids[0].split('::')[0]}` against the tree before and with this "
        "change):", "",
        "| test | before | with this change |", "|---|---|---|", *rows])


def add_deliver_commands(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    w = sub.add_parser(
        "wheel", formatter_class=fmt,
        help="patched vLLM wheel from the official one (no CUDA build)",
        description="Apply a stack and write the official vLLM wheel of the "
        "base's release with exactly the files the patched tree changes "
        "replaced (new ones added, deleted ones removed), a PEP 440 local "
        "version naming the series (<release>+<stack>.<hash>) in its metadata "
        "and vllm/_version.py, and RECORD regenerated by 'wheel pack'. Refuses "
        "a series that changes compiled sources (csrc/, CMake, *.cu, *.cpp, "
        "setup.py) and a wheel of another version. Needs the 'wheel' package "
        "(>=0.48) in the --python.",
        epilog="example:\n  python apply.py wheel --stack tq --out dist\n"
        "  python apply.py wheel --base v0.20.2 --from-wheel "
        "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl")
    w.add_argument("--base", default=argparse.SUPPRESS,
                   help="base release vX.Y.Z (default: the stack's pin)")
    w.add_argument("--from-wheel", metavar="FILE",
                   help="the official wheel (default: from the tool's cache, "
                   "else downloaded with pip)")
    w.add_argument("--out", default="dist", help="output directory (default: "
                   "./dist)")
    w.set_defaults(func=cmd_wheel)
    common(w, "stack", "repo", "python", "offline", "json")

    e = sub.add_parser(
        "export", formatter_class=fmt,
        help="one upstream PR branch for one patch",
        description="Create a branch (default refs/heads/patched/pr/<patch>) in "
        "the vLLM repository (--repo, else the tool's cache) with the patch as "
        "one commit on the stack's base (or on the patches before it, when it "
        "only applies there), its message in vLLM's PR template (Purpose, Test "
        "Plan, Test Result; FIX #N from Bug: issues), signed off, and its "
        "regression test adapted into vLLM's tests/. Prints the push and "
        "PR-creation commands. The checkout, its index and other branches are "
        "never touched.",
        epilog="example:\n  python apply.py export tq/0001 --repo ~/src/vllm\n"
        "  git -C ~/src/vllm log -1 -p patched/pr/0001-...")
    e.add_argument("patch", help="patch file name or unique prefix")
    e.add_argument("--branch", help="branch name (default: patched/pr/<patch>)")
    e.add_argument("--base", default=argparse.SUPPRESS,
                   help="base revision (default: the stack's pin)")
    e.add_argument("--test-dir", help="where the test goes in vLLM's tree "
                   "(default: by the subject's [Component], else tests/ "
                   "mirroring the changed module)")
    e.add_argument("--run-tests", action="store_true",
                   help="run the regression tests before and with the change "
                   "and put the results in Test Result")
    e.add_argument("--force", action="store_true",
                   help="overwrite an existing branch outside the tool's "
                   "namespace")
    e.set_defaults(func=cmd_export)
    common(e, "repo", "python", "offline", "json")


# --------------------------------------------------------------------------
# command line


def parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="apply.py", formatter_class=fmt,
        description="Apply the vLLM patch series onto a base, run each patch's "
        "targeted tests, and report.",
        epilog="examples:\n"
        "  python apply.py                      # every stack at its pin\n"
        "  python apply.py --base v0.20.2 --repo ~/src/vllm --json out.json\n"
        "commands: check, test, base, format-patch, rebase, status, wheel,\n"
        "          export (each has --help with an example)\n"
        "exit: 0 ok, 1 conflict or test failure, 2 bad input")
    p.add_argument("--series", default=str(PROJECT / "series"),
                   help="series file (default: ./series beside apply.py)")
    p.add_argument("--base", help="base revision (default: each stack's pin)")
    p.add_argument("--repo", help="vLLM git repository (default: $VLLM_REPO, "
                   "./vllm, else the tool's cache filled from a remote or PyPI)")
    p.add_argument("--stack", help="stack to apply (default: all; with --base, "
                   "the first)")
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--require-all", action="store_true",
                   help="a stack skipped for want of its base is an error")
    p.add_argument("--no-tests", action="store_true", help="apply only")
    p.add_argument("--offline", action="store_true",
                   default=bool(os.environ.get("VLLM_PATCHES_OFFLINE")),
                   help="never try git remotes (also $VLLM_PATCHES_OFFLINE=1)")
    p.add_argument("--python", help="Python that runs the targeted tests "
                   "(default: $VLLM_PATCHES_PYTHON, ./.venv, this one)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    c = sub.add_parser("check", formatter_class=fmt,
                       help="lint the series and patches (fast, offline)",
                       description="Check that series and patches/ agree, every "
                       "patch parses with the required trailers, touches only "
                       "safe paths, and re-exports byte-identically.",
                       epilog="example:\n  python apply.py check")
    c.set_defaults(func=cmd_check)

    t = sub.add_parser("test", formatter_class=fmt,
                       help="run patches' targeted tests against a tree",
                       description="Run the targeted tests (Tests: trailers) of "
                       "the given patches (default: all) against a vLLM tree.",
                       epilog="example:\n  python apply.py test 0002 --tree "
                       "~/src/vllm")
    t.add_argument("patches", nargs="*", help="patch file names or prefixes")
    t.add_argument("--tree", required=True, help="vLLM source tree root")
    t.add_argument("--json", help="write results here")
    t.set_defaults(func=cmd_test)

    b = sub.add_parser("base", formatter_class=fmt,
                       help="obtain a base (remote or PyPI release) and print it",
                       description="Resolve a stack's base, obtaining it into "
                       "the tool's cache repository if needed.",
                       epilog="example:\n  python apply.py base v0.21.0")
    b.add_argument("rev", nargs="?", help="revision (default: the stack's pin)")
    b.set_defaults(func=cmd_base)

    f = sub.add_parser("format-patch", formatter_class=fmt,
                       help="export one commit deterministically",
                       description="Export one commit as a patch file with the "
                       "series' pinned format-patch flags.",
                       epilog="example:\n  python apply.py format-patch --repo "
                       "../vllm HEAD --out patches/tq/0004-x.patch")
    f.add_argument("rev", nargs="?", default="HEAD")
    f.add_argument("--repo", required=True)
    f.add_argument("--out")
    f.set_defaults(func=cmd_format_patch)
    for sp in (t, b):
        common(sp, "python", "offline")
    common(b, "stack", "repo")
    common(c, "repo")
    add_rebase_commands(sub)
    add_deliver_commands(sub)
    for sp in sub.choices.values():
        common(sp, "series")
    return p


def common(sp: argparse.ArgumentParser, *names: str) -> None:
    """The global options, accepted after a command too."""
    helps = {"series": "series file", "repo": "vLLM git repository",
             "stack": "stack name", "python": "Python that runs the tests",
             "offline": "never try git remotes", "json": "write JSON here"}
    for n in names:
        if n == "offline":
            sp.add_argument("--offline", action="store_true",
                            default=argparse.SUPPRESS, help=helps[n])
        else:
            sp.add_argument(f"--{n}", default=argparse.SUPPRESS, help=helps[n])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if getattr(args, "func", None):
            return args.func(args)
        return cmd_apply(args)
    except UserError as e:
        say(f"apply.py: error: {e}")
        return 2
    except GitError as e:
        say(f"apply.py: error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
