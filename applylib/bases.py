"""Bases: a user repository, or the tool's cache filled from git remotes
and release wheels; and the tool's own worktrees."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .core import (
    BASE_DATE,
    IDENTITY,
    TOOL_NAME,
    UPSTREAM_URL,
    UserError,
    child_output,
    failed,
    git,
    git_common_dir,
    gout,
    open_repo,
    probe_writable,
    rev_commit,
    room,
    say,
)
from .pinned import pinned_files, read_pinned
from .probe import pick_python
from .series import Stack
from .sources import import_files, installed_files, version_commit, wheel_files


def cache_dir() -> Path:
    """The tool's cache (bases, worktrees, wheels), checked writable: a
    run in a cache it cannot write would read the failures as verdicts."""
    if os.environ.get("VLLM_PATCHES_CACHE"):
        path = Path(os.environ["VLLM_PATCHES_CACHE"]).expanduser().resolve()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base).expanduser().resolve() / TOOL_NAME
    return writable_cache(path)


@functools.cache
def writable_cache(path: Path) -> Path:
    """`path`, checked writable and with room for a base (a release wheel,
    its commit and the worktrees: $VLLM_PATCHES_MIN_FREE_MB, 2048)."""
    try:
        probe_writable(path)
    except OSError as e:
        raise UserError(
            f"the tool's cache {path} is not writable ({e.strerror}): "
            "set VLLM_PATCHES_CACHE to a writable directory"
        ) from None
    hint = "free space, or set VLLM_PATCHES_CACHE to a disk with room"
    room(path, min_free_mb(), "the tool's cache", hint)
    return path


def min_free_mb() -> int:
    """The room a run needs in the cache ($VLLM_PATCHES_MIN_FREE_MB, 2048:
    a release wheel, its commit and the worktrees)."""
    return int(os.environ.get("VLLM_PATCHES_MIN_FREE_MB", "2048"))


# the lock of the cache's release commits and refs (`locked`)
RELEASES = ("releases", "the cache's releases")


@contextlib.contextmanager
def locked(name: str, what: str = "its repository"):
    """One run at a time on `name` (a repository: the worktrees are shared
    state; the cache's creation; its downloads): a run that finds it busy
    says so and waits."""
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            say(f"apply.py: waiting for another run (pid {holder}) using {what}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


def repo_lock(repo: Path) -> str:
    """The name of `repo`'s lock (`locked`): one per repository, however
    it is reached (a worktree, a path with a link). The run writes there
    (the patched commits): its filesystem is checked for room."""
    common = git_common_dir(repo)
    room(common, min(min_free_mb(), 64), "the repository", "free space there")
    return hashlib.sha1(str(common).encode()).hexdigest()[:10]


def ref_label(rev: str) -> str:
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", rev).strip(".-") or "base"
    return label[:60]


RELEASE_TAG = re.compile(r"^v?(\d+\.\d+\.\d+(?:\.post\d+)?)$")


@dataclasses.dataclass
class Base:
    repo: Path
    rev: str
    commit: str
    source: str  # "repo" | "cache" | "pypi" | "remote" | "fetched"
    upstream_commit: str | None = None
    fetched: str | None = None  # source "fetched": the directory of pinned files
    # source "fetched": release, release_commit, files (what assemble_base made)
    assembled: dict | None = None


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
    if Path(".git").exists() and (local / "__init__.py").is_file():
        return open_repo(Path("."))  # run inside a vLLM clone
    return None


def describe_base(rev: str, user_repo: Path | None) -> tuple[str, str] | None:
    """The release tag a base that is no release stands on, and a line
    saying so: from the user's clone (git describe), or, without one, the
    release whose upstream commit `rev` is (the cache's materialized
    releases record it). None when neither knows."""
    if user_repo is not None:
        commit = rev_commit(user_repo, rev)
        if commit is None:
            raise UserError(f"unknown revision '{rev}' in {user_repo}")
        # releases only: a release candidate (v0.34.0rc1) is no release
        releases = ["--match", "v[0-9]*", "--exclude", "v*[!0-9.]*"]
        describe = ["describe", "--tags", "--long", *releases, commit]
        desc = git(*describe, cwd=user_repo, check=False).stdout.decode().strip()
        m = re.fullmatch(r"(.+)-(\d+)-g[0-9a-f]+", desc)
        if not m or not RELEASE_TAG.match(m.group(1)):
            return None
        tag, n = m.group(1), int(m.group(2))
        more = f" + {n} commit{'s' if n != 1 else ''}" if n else ""
        return tag, f"base {rev} ({commit[:12]}) = {tag}{more}"
    if not re.fullmatch(r"[0-9a-f]{7,40}", rev):
        return None
    cache = cache_repo()
    for tag in gout("tag", "--list", "v[0-9]*", cwd=cache).split():
        up = upstream_commit_of(cache, tag) if RELEASE_TAG.match(tag) else None
        if up and len(up) >= 7 and (up.startswith(rev) or rev.startswith(up)):
            return tag, f"base {rev} = {tag} (its upstream commit, in the cache)"
    return None


BUILT = ("wheel", "installed")  # Base.source of a base read from a built vLLM


def built_version(rev: str, python: str | None) -> tuple[str, str] | None:
    """(label, version) of a base read from a built vLLM: `--base FILE.whl`
    (a wheel file's name and version) or `--base installed` (the vLLM
    installed for --python); None for any other base."""
    if rev == "installed":
        _, info = pick_python(python)
        return f"installed-{info['version']}", info["version"]
    if rev.endswith(".whl"):
        wheel = Path(rev).expanduser()
        m = re.fullmatch(r"vllm-([^-]+)-.+\.whl", wheel.name)
        if not wheel.is_file() or not m:
            why = "not a file" if not wheel.is_file() else "not a vllm wheel's name"
            raise UserError(f"--base {rev}: {why}")
        return wheel.name, m.group(1)
    return None


@functools.cache
def built_base(rev: str, python: str | None) -> Base | None:
    """A base read from a built vLLM (built_version): the Python sources of
    the wheel file, or of the installed vllm package, committed in the
    cache repository as one root commit (the same files give the same id)."""
    known = built_version(rev, python)
    if known is None:
        return None
    label, version = known
    if rev == "installed":
        py, info = pick_python(python)
        files, what = installed_files(Path(info["package"])), f"installed for {py}"
    else:
        files, what = wheel_files(Path(rev).expanduser()), f"from {label}"
    repo = cache_repo()
    up = version_commit(files)
    msg = (
        f"vLLM {version} (Python sources {what})\n\n"
        "Committed by apply.py: every file under vllm/ except compiled\n"
        "extensions and bytecode.\n\n"
        f"Built-Version: {version}\n" + (f"Upstream-Commit: {up}\n" if up else "")
    )
    c = import_files(repo, files, msg)
    with locked(*RELEASES):
        git("update-ref", f"refs/{TOOL_NAME}/built/{ref_label(label)}", c, cwd=repo)
    source = "installed" if rev == "installed" else "wheel"
    return Base(repo, ref_label(label), c, source, up)


def cache_repo() -> Path:
    """The cache's bare repository, made whole before any run sees it."""
    repo = cache_dir() / "vllm.git"
    if (repo / "HEAD").exists():
        return repo
    with locked("cache", "the new cache"):
        if not (repo / "HEAD").exists():
            tmp = Path(tempfile.mkdtemp(dir=repo.parent, prefix=".vllm.git-"))
            git("init", "-q", "--bare", str(tmp))
            git("config", "gc.auto", "0", cwd=tmp)
            os.replace(tmp, repo)
    return repo


def upstream_commit_of(repo: Path, commit: str) -> str | None:
    msg = gout("log", "-1", "--format=%B", commit, cwd=repo)
    m = re.search(r"^Upstream-Commit: (\S+)$", msg, re.MULTILINE)
    return m.group(1) if m else None


def with_pinned_base(
    stack: Stack,
    rev: str | None,
    user_repo: Path | None,
    offline: bool,
    fetched: Path | None = None,
    python: str | None = None,
) -> tuple[Base, Base | None]:
    """resolve_base for `rev`, and the stack's pinned base when `rev` is
    another base (obtained into the same repository, from its wheel if need
    be): git am's 3-way fallback merges from the blobs the patches were made
    on (runner.preimages), and without them a drifted patch fails outright
    instead of merging or conflicting. The pinned base is sought only
    once `rev`'s is at hand: a base that cannot be had downloads nothing.
    `python`: whose vLLM `--base installed` means."""
    base = resolve_base(stack, rev, user_repo, offline, fetched, python)
    pinned = None
    if rev is not None and not is_pinned_release(stack, base, rev, python):
        if base.source in BUILT:  # in the cache repository, where its pin goes
            user_repo = None
        with contextlib.suppress(BaseUnavailable):
            pinned = resolve_base(stack, None, user_repo, offline, fetched)
    if pinned is not None and (pinned.repo, pinned.commit) == (base.repo, base.commit):
        pinned = None
    return base, pinned


def is_pinned_release(stack: Stack, base: Base, rev: str, python: str | None) -> bool:
    """A built vLLM (wheel, installed) of the very release the stack is
    pinned to: its files are the pin's, none to download for the 3-way."""
    known = built_version(rev, python) if base.source in BUILT else None
    pin = RELEASE_TAG.match(stack.pins.get("tag") or "")
    return bool(known and pin and known[1] == pin.group(1))


def resolve_base(
    stack: Stack,
    rev: str | None,
    user_repo: Path | None,
    offline: bool,
    fetched: Path | None = None,
    python: str | None = None,
) -> Base:
    """Find the stack's base, obtaining it into the cache repo if needed:
    a built vLLM's (built_base), else find_base's.

    The stack's own base (no `rev`) that cannot be had, of a stack that
    names a release to assemble it from (assemble=), is assembled offline
    from that release and the pinned files in `fetched` (assemble_base).
    """
    built = built_base(rev, python) if rev else None
    if built is not None:
        return built
    try:
        return find_base(stack, rev, user_repo, offline)
    except BaseUnavailable:
        if rev is None and fetched is not None and stack.pins.get("assemble"):
            return assemble_base(stack, fetched)
        raise


def rev_forms(rev: str) -> list[str]:
    """The revisions a --base names: itself, and a release's tag (0.33.0:
    v0.33.0)."""
    if RELEASE_TAG.match(rev) and not rev.startswith("v"):
        return [rev, f"v{rev}"]
    return [rev]


def find_base(
    stack: Stack, rev: str | None, user_repo: Path | None, offline: bool
) -> Base:
    pins = stack.pins
    candidates = (
        rev_forms(rev)
        if rev
        else [r for r in (pins.get("commit"), pins.get("tag"), pins.get("branch")) if r]
    )
    if user_repo is not None:
        for r in candidates:
            c = rev_commit(user_repo, r)
            if c:
                return Base(user_repo, r, c, "repo")
        if rev:
            raise UserError(f"unknown revision '{rev}' in {user_repo}")
        raise BaseUnavailable(
            f"{user_repo} has none of {', '.join(candidates)}",
            stack.fetch_hint(user_repo),
        )
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
            say(
                f"warning: PyPI {release} says it was built from {up}, but the "
                f"stack pins {pin}"
            )
        return Base(repo, shown, c, "pypi", up)
    if rev:  # what the user asked for cannot be had: their input, exit 2
        where = f"; {errors[0]}" if errors else ""
        raise UserError(
            f"unknown revision '{rev}': not a release (vX.Y.Z), not in the "
            f"cache{where}: give --repo a clone that has it"
        )
    raise BaseUnavailable(
        "; ".join(errors) or f"base {shown} is not a release and not cached",
        stack.fetch_hint(repo),
    )


def fetch_remote(repo: Path, url: str, want: str) -> str | None:
    timeout = float(os.environ.get("VLLM_PATCHES_FETCH_TIMEOUT", "60"))
    ref = f"refs/{TOOL_NAME}/fetched/{ref_label(want)}"
    src = want
    if RELEASE_TAG.match(want):
        src = f"refs/tags/{want}"
    try:
        proc = git(
            "fetch",
            "--quiet",
            "--depth=1",
            "--no-tags",
            url,
            f"+{src}:{ref}",
            cwd=repo,
            check=False,
            timeout=timeout,
        )
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


def index_versions(pip_line: str) -> list[str] | None:
    """The releases pip's "Could not find a version" line lists, oldest
    first; None for any other line or an empty list (nothing reached)."""
    m = re.search(r"\(from versions: ([^)]*)\)", pip_line)
    if not m or m.group(1).strip() in ("", "none"):
        return None
    return [v.strip() for v in m.group(1).split(",")]


def release_wheel(version: str) -> Path:
    """The official wheel of a release: from the cache, or downloaded by pip."""
    dist = cache_dir() / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    with locked(f"dist-{version}", f"the download of vllm {version}"):
        found = sorted(dist.glob(f"vllm-{version}-*.whl"))
        return found[0] if found else download_wheel(version, dist)


def download_wheel(version: str, dist: Path) -> Path:
    """pip download the release's wheel into `dist`, whole or not at all."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dist) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            *pip_platform_args(),
            "-d",
            tmp,
            f"vllm=={version}",
        ]
        rc, tail, versions = pip_download(cmd, version, dist)
        if rc != 0:
            failed(f"pip download vllm=={version}", rc, "\n".join(tail))
            if versions:  # the index answered, without this release
                raise UserError(
                    f"vllm {version} is not a release with a wheel for Linux "
                    f"x86_64 (the newest is {versions[-1]})"
                )
            raise BaseUnavailable(
                f"pip could not download vllm=={version}: {' / '.join(tail)}",
                f"pip download --no-deps --only-binary=:all: vllm=={version} -d {dist}",
            )
        got = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if not got:
            raise BaseUnavailable(
                f"pip gave no vllm {version} wheel", f"pip download vllm=={version}"
            )
        final = dist / got[0].name
        os.replace(got[0], final)
    say(
        f"  downloaded {final.name} ({final.stat().st_size / 1e6:.0f} MB) in "
        f"{time.monotonic() - t0:.0f} s"
    )
    return final


def pip_download(cmd: list[str], version: str, dist: Path):
    """Run pip download, saying what it fetches: (exit status, its last
    lines, the releases the index listed when it lacks this one). An
    interrupt ends pip too."""
    tail, versions = [], None
    with child_output(cmd) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith("WARNING: Location"):
                continue
            tail = (tail + [line])[-5:]
            if line.startswith("Collecting"):  # pip found the release
                say(
                    f"apply.py: downloading the vllm {version} release wheel "
                    f"with pip (250-340 MB, once; cached in {dist})"
                )
            if line.startswith(("Collecting", "Downloading", "Saved")):
                say(f"  pip: {line.strip()}")
            versions = index_versions(line) or versions
    return proc.returncode, tail, versions


def materialize_release(repo: Path, version: str, wheel: Path | None = None) -> str:
    """Commit a release's Python sources (from its wheel) as tag vX.Y.Z.

    One root commit per release, all of vllm/ but compiled extensions, with
    fixed author, committer and date, so the same release gives the same
    commit id everywhere. The upstream commit the release was built from
    (vllm/_version.py's __commit_id__) is recorded as a trailer.
    """
    tag = f"v{version}"
    c = rev_commit(repo, f"refs/tags/{tag}")
    if c:
        return c
    with locked(*RELEASES):
        return rev_commit(repo, f"refs/tags/{tag}") or commit_release(
            repo, version, wheel or release_wheel(version)
        )


def commit_release(repo: Path, version: str, wheel: Path) -> str:
    tag = f"v{version}"
    say(f"apply.py: committing {wheel.name} as {tag} in {repo}")
    files = wheel_files(wheel)
    upstream = version_commit(files)
    msg = (
        f"vLLM {version} (Python sources of the release wheel)\n\n"
        f"Materialized by apply.py from {wheel.name}: every file under vllm/\n"
        "except compiled extensions.\n\n"
        f"Release: {version}\n" + (f"Upstream-Commit: {upstream}\n" if upstream else "")
    )
    c = import_files(repo, files, msg)
    git("update-ref", f"refs/tags/{tag}", c, cwd=repo)
    return c


def assemble_base(stack: Stack, fetched: Path) -> Base:
    """The stack's base, assembled offline: the release named by assemble=
    (committed from its wheel) with each file the patches change replaced by
    its pinned version from `fetched`, each checked against the blob id the
    patch was made on. One commit on the release's, with fixed author and
    date: the same release and files give the same commit id everywhere."""
    release = RELEASE_TAG.match(stack.pins["assemble"]).group(1)
    repo = cache_repo()
    rel = materialize_release(repo, release)
    taken = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", rel, cwd=repo, env=env)
        for f in pinned_files(stack):
            have = git(
                "rev-parse", "-q", "--verify", f"{rel}:{f.path}", cwd=repo, check=False
            )
            if have.stdout.decode().strip() == f.blob:
                continue  # the release already holds it
            data = read_pinned(f, fetched)
            oid = gout("hash-object", "-w", "--stdin", cwd=repo, input=data)
            info = f"{f.mode},{oid},{f.path}"
            git("update-index", "--add", "--cacheinfo", info, cwd=repo, env=env)
            taken.append(f)
        tree = gout("write-tree", cwd=repo, env=env)
    lines = [
        f"{stack.name} base: vLLM {release} with the stack's pinned files",
        "",
        f"Assembled by apply.py: the Python sources of the vLLM {release}",
        "release wheel, with these files as they are at their pins:",
        "",
    ]
    for f in taken:
        lines += [f"  {f.path}", f"    {f.repo} {f.commit}", f"    blob {f.blob}"]
    lines += ["", f"Assembled-From: v{release}"]
    ident = {
        "GIT_AUTHOR_NAME": IDENTITY[0],
        "GIT_AUTHOR_EMAIL": IDENTITY[1],
        "GIT_AUTHOR_DATE": BASE_DATE,
        "GIT_COMMITTER_NAME": IDENTITY[0],
        "GIT_COMMITTER_EMAIL": IDENTITY[1],
        "GIT_COMMITTER_DATE": BASE_DATE,
    }
    msg = ("\n".join(lines) + "\n").encode()
    c = gout("commit-tree", tree, "-p", rel, cwd=repo, env=ident, input=msg)
    with locked(*RELEASES):
        git("update-ref", f"refs/{TOOL_NAME}/assembled/{stack.name}", c, cwd=repo)
    files = [dataclasses.asdict(f) for f in taken]
    return Base(
        repo,
        f"v{release}+pins",
        c,
        "fetched",
        fetched=str(fetched),
        assembled={"release": f"v{release}", "release_commit": rel, "files": files},
    )


def worktree(repo: Path, key: str, commit: str) -> Path:
    """A worktree of the tool's own at `commit`, reused and reset between runs.

    Whatever a killed run left (an am in progress, a stale index lock, a
    half-made worktree) is cleared here, so the next run starts clean.
    """
    common = git_common_dir(repo)
    rid = hashlib.sha1(str(common).encode()).hexdigest()[:10]
    path = cache_dir() / "worktrees" / rid / key
    # Registered and intact: <path>/.git names an admin dir of this repo
    # whose gitdir file points back (read directly: no git process needed).
    admin = None
    with contextlib.suppress(OSError, ValueError):
        text = (path / ".git").read_text().strip()
        if text.startswith("gitdir: "):
            admin = Path(text[len("gitdir: ") :])
            back = (admin / "gitdir").read_text().strip()
            if admin.parent != common / "worktrees" or Path(back) != path / ".git":
                admin = None
    usable = admin is not None
    if admin is not None:
        for stale in ("index.lock", "HEAD.lock"):
            (admin / stale).unlink(missing_ok=True)
        shutil.rmtree(admin / "rebase-apply", ignore_errors=True)
        proc = git("checkout", "-q", "-f", "--detach", commit, cwd=path, check=False)
        usable = proc.returncode == 0
        if usable:
            git("clean", "-fdq", "-e", "__pycache__", cwd=path)
    if not usable:
        git(
            "worktree", "remove", "--force", "--force", str(path), cwd=repo, check=False
        )
        shutil.rmtree(path, ignore_errors=True)
        git("worktree", "prune", cwd=repo)
        path.parent.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "-q", "--detach", str(path), commit, cwd=repo)
    return path
