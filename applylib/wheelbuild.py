"""apply.py wheel: a patched vLLM wheel from the official release wheel."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path, PurePosixPath

from .bases import (
    RELEASE_TAG,
    Base,
    BaseUnavailable,
    find_user_repo,
    locked,
    release_wheel,
    repo_lock,
    resolve_base,
    worktree,
)
from .core import (
    BASE_DATE,
    UserError,
    common,
    failed,
    git,
    gout,
    room,
    say,
)
from .pinned import fetched_dir
from .runner import PatchResult, apply_stack
from .series import (
    Patch,
    Series,
    Stack,
    load_patch,
    parse_series,
)
from .testrun import test_python

# What a patched wheel cannot carry: the sources of compiled extensions.
COMPILED_SOURCE = re.compile(
    r"^(?:csrc|cmake)/|(?:^|/)CMakeLists\.txt$|^setup\.py$"
    r"|\.(?:cu|cuh|c|cc|cpp|cxx|h|hpp)$"
)


# PEP 427: {name}-{version}(-{build})?-{python}-{abi}-{platform}.whl
WHEEL_FILE = re.compile(
    r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(?:-(?P<build>\d[^-]*))?"
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


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
        return subprocess.run(
            [python, "-m", "wheel", *args], capture_output=True, text=True, env=env
        )
    except OSError as e:
        raise UserError(f"cannot run the Python '{python}': {e}") from None


def check_wheel_tool(python: str) -> None:
    proc = wheel_cli(python, "pack", "--help")
    if proc.returncode == 0 and "--local-version" in proc.stdout:
        return
    why = "is too old in" if proc.returncode == 0 else "is missing from"
    raise UserError(
        f"the 'wheel' package {why} {python} (need wheel>=0.48 for "
        f"'wheel pack --local-version'): {python} -m pip install -U "
        "'wheel>=0.48' (or name another Python with --python)"
    )


def wheel_step(python: str, *args: str) -> None:
    proc = wheel_cli(python, *args)
    if proc.returncode != 0:
        failed(f"wheel {args[0]}", proc.returncode, proc.stdout + proc.stderr)
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"wheel {args[0]} failed: {last}")


def stack_release(stack: Stack, rev: str | None, base: Base) -> str | None:
    """The vLLM release a base is (X.Y.Z), if it is one; for a base
    assembled from a release and pinned files, that release."""
    if base.assembled:
        return base.assembled["release"].lstrip("v")
    for r in [rev] if rev else [stack.pins.get("tag")]:
        if r and RELEASE_TAG.match(r):
            return RELEASE_TAG.match(r).group(1)
    msg = gout("log", "-1", "--format=%B", base.commit, cwd=base.repo)
    m = re.search(r"^Release: (\S+)$", msg, re.M)  # a materialized release
    return m.group(1) if m else None


def tree_changes(repo: Path, old: str, new: str) -> dict[str, str]:
    """{path: A | M | D} between two commits, renames as delete + add."""
    out = (
        git("diff", "--name-status", "-z", "--no-renames", old, new, cwd=repo)
        .stdout.decode()
        .split("\0")
    )
    changes = {}
    for status, path in zip(out[0::2], out[1::2], strict=False):
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


def record_hash(data: bytes) -> str:
    """sha256 as a wheel's RECORD writes it."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def blob_hashes(repo: Path, rev: str, paths: list[str]) -> dict[str, str]:
    """{path: RECORD-style sha256} of the given paths that exist at `rev`."""
    return {
        path: record_hash(git("cat-file", "blob", oid, cwd=repo).stdout)
        for path, (_, oid) in tree_blobs(repo, rev, paths).items()
    }


def file_hashes(
    repo: Path, old: str, new: str, paths: list[str]
) -> dict[str, dict[str, str | None]]:
    """For each path, its hash in the release and in the patched tree
    (None where it does not exist): what status --installed compares an
    installed file with."""
    release, patched = blob_hashes(repo, old, paths), blob_hashes(repo, new, paths)
    return {p: {"release": release.get(p), "patched": patched.get(p)} for p in paths}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def set_version_py(path: Path, release: str, version: str, local: str) -> None:
    """vllm/_version.py (written by setuptools-scm) names the local version."""
    import ast

    text = path.read_text()
    m1 = re.search(r"^(__version__ = version = )(['\"])([^'\"]*)\2$", text, re.M)
    m2 = re.search(r"^(__version_tuple__ = version_tuple = )(\(.*\))$", text, re.M)
    if not m1 or not m2 or m1.group(3) != release:
        raise UserError(
            f"vllm/_version.py of the wheel does not read "
            f"'__version__ = version = {release!r}' and "
            "'__version_tuple__ = version_tuple = (...)'"
        )
    old = ast.literal_eval(m2.group(2))
    text = text[: m1.start()] + m1.group(1) + repr(version) + text[m1.end() :]
    m2 = re.search(r"^(__version_tuple__ = version_tuple = )(\(.*\))$", text, re.M)
    text = (
        text[: m2.start()]
        + m2.group(1)
        + repr(tuple(old) + (local,))
        + text[m2.end() :]
    )
    path.write_text(text)


def set_wheel_tags(wheel_meta: Path, name: re.Match) -> None:
    """Tag: lines of .dist-info/WHEEL as the file name says.

    `wheel pack` names its output from these lines; vLLM's release wheels are
    renamed to manylinux_* after the build, so their WHEEL still says
    linux_x86_64. The output keeps the input's file-name tags.
    """
    tags = [
        f"{p}-{a}-{t}"
        for p in name["py"].split(".")
        for a in name["abi"].split(".")
        for t in name["plat"].split(".")
    ]
    lines = wheel_meta.read_text().splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("Tag:")), len(lines))
    rest = [ln for ln in lines if not ln.startswith("Tag:")]
    rest[at:at] = [f"Tag: {t}" for t in tags]
    wheel_meta.write_text("\n".join(rest) + "\n")


def differing_files(
    src: Path,
    changes: dict[str, str],
    old: dict[str, tuple[str, str]],
    rev: str,
    force: bool,
) -> list[str]:
    """The wheel's copy of every file the series changes must be the base
    tree's: else the patch was checked against another file. Refused
    unless `force` (then a warning note)."""
    import zipfile

    notes = []
    with zipfile.ZipFile(src) as zf:
        have = set(zf.namelist())
        for path, status in sorted(changes.items()):
            if status not in ("M", "D") or path not in have:
                continue
            if git_blob_id(zf.read(path)) == old[path][1]:
                continue
            if not force:
                raise UserError(
                    f"{src.name}'s {path} differs from base {rev}'s: the patch "
                    "was checked against another file (give the wheel of that "
                    "base, or --force)"
                )
            notes.append(
                f"warning: {path} in the official wheel differs from base "
                f"{rev}'s (--force)"
            )
    return notes


def cmd_wheel(args: argparse.Namespace) -> int:
    """apply.py wheel: the official wheel with the patched tree's files."""
    return 0 if make_wheel(args, wheel_job(args)) else 1


def make_wheel(args: argparse.Namespace, job: WheelJob) -> Path | None:
    """The patched wheel of `job` written into --out, and reported; None
    (after saying which patches conflict) where the stack does not apply."""
    t_start = time.monotonic()
    tree = patched_tree(job)
    if tree is None:
        return None
    notes = differing_files(job.src, tree.changes, tree.old, job.base.rev, args.force)
    src_size = job.src.stat().st_size
    src_sha256 = file_sha256(job.src)
    out_dir = Path(args.out).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    room(out_dir, 2 * src_size // 2**20 + 1, "the wheel's folder", "free space")
    say(
        f"apply.py wheel: {job.src.name} + stack {job.stack.name} "
        f"({len(job.patches)} patch(es), {len(tree.changes)} file(s)) -> "
        f"{job.version}"
    )
    built = build_wheel(job, tree, src_sha256, out_dir, notes)
    seconds = time.monotonic() - t_start
    report_wheel(job, built, notes, seconds, src_size, args.json)
    return built.out


@dataclasses.dataclass
class WheelJob:
    """What the wheel is made of: a stack on a release base, and the
    official wheel of that release."""

    series: Series
    stack: Stack
    patches: list[Patch]
    python: str
    base: Base
    release: str
    src: Path
    name: re.Match
    local: str
    version: str


def wheel_job(args: argparse.Namespace) -> WheelJob:
    """The command line's stack, base and official wheel, checked."""
    series = parse_series(Path(args.series))
    stack = series.pick_stack(args.stack, args.base)
    patches = wheel_patches(series, stack)
    python = test_python(args.python)
    check_wheel_tool(python)
    user_repo = find_user_repo(args.repo)
    try:
        base = resolve_base(
            stack, args.base, user_repo, args.offline, fetched_dir(args)
        )
        release = stack_release(stack, args.base, base)
        if release is None:
            raise UserError(
                f"base '{base.rev}' is not a vLLM release: give "
                "--base vX.Y.Z (the release the wheel is of)"
            )
        src = (
            Path(args.from_wheel).expanduser().resolve()
            if args.from_wheel
            else release_wheel(release)
        )
    except BaseUnavailable as e:
        raise UserError(f"{e.reason} (to get it: {e.hint})") from None
    name = official_wheel_name(src, base, release)
    local = (
        re.sub(r"[^a-z0-9]+", "", stack.name.lower()) + "." + series.digest(stack)[:8]
    )
    return WheelJob(
        series=series,
        stack=stack,
        patches=patches,
        python=python,
        base=base,
        release=release,
        src=src,
        name=name,
        local=local,
        version=f"{release}+{local}",
    )


def wheel_patches(series: Series, stack: Stack) -> list[Patch]:
    """The stack's patches, refused where one changes a compiled source."""
    patches = [load_patch(series, p) for p in stack.patches]
    if not patches:
        raise UserError(f"stack '{stack.name}' lists no patch")
    for p in patches:
        for f in p.files:
            if COMPILED_SOURCE.search(f):
                raise UserError(
                    f"patches/{p.file} changes {f}, a source of vLLM's compiled "
                    "extensions: a patched wheel cannot carry that without a "
                    "CUDA rebuild (build vLLM from the patched tree instead)"
                )
    return patches


def official_wheel_name(src: Path, base: Base, release: str) -> re.Match:
    """The official wheel's file name, parsed: a vLLM wheel of `release`."""
    if not src.is_file():
        raise UserError(f"{src}: no such wheel file")
    name = WHEEL_FILE.match(src.name)
    if not name or name["name"].lower() != "vllm":
        raise UserError(
            f"{src.name}: not a vLLM wheel file name (vllm-VERSION-PY-ABI-PLATFORM.whl)"
        )
    if name["ver"] != release:
        raise UserError(
            f"{src.name} is vLLM {name['ver']}, but the base "
            f"{base.rev} is release {release}: give the official "
            f"vllm {release} wheel (or --base v{name['ver']})"
        )
    return name


@dataclasses.dataclass
class PatchedTree:
    """The files the patched tree changes from the release's tree."""

    changes: dict[str, str]  # path -> A | M | D
    new: dict[str, tuple[str, str]]  # path -> (mode, blob) in the patched tree
    old: dict[str, tuple[str, str]]  # path -> (mode, blob) in the release's
    data: dict[str, bytes]  # path -> the patched tree's bytes
    hashes: dict[str, dict[str, str | None]]  # every patched file's hashes


def patched_tree(job: WheelJob) -> PatchedTree | None:
    """The stack applied on its base, and what it changes; None (after
    saying which patches conflict) where it does not apply."""
    base, patches = job.base, job.patches
    results = {p.file: PatchResult(p.file) for p in patches}
    with locked(repo_lock(base.repo)):
        wt = worktree(base.repo, f"{job.stack.name}-wheel", base.commit)
        conflicts = apply_stack(wt, patches, results)
        if conflicts:
            for p in conflicts:
                files = ", ".join(results[p.file].conflict_files) or "?"
                print(f"{p.file}: does not apply on {base.rev} (conflicts in {files})")
            say(
                f"apply.py wheel: {len(conflicts)} patch(es) do not apply on "
                f"{base.rev}; no wheel written"
            )
            return None
        head = gout("rev-parse", "HEAD", cwd=wt)
        # An assembled base ships its pinned files too: the wheel is the
        # release's, so the changes are counted from the release's tree.
        since = base.assembled["release_commit"] if base.assembled else base.commit
        changes = tree_changes(wt, since, head)
        new = tree_blobs(wt, head, [p for p, s in changes.items() if s != "D"])
        old = tree_blobs(wt, since, [p for p, s in changes.items() if s != "A"])
        data = blob_data(wt, new)
        every = sorted({f for p in patches for f in p.files})
        hashes = file_hashes(wt, base.commit, head, every)
    return PatchedTree(changes, new, old, data, hashes)


def blob_data(repo: Path, blobs: dict[str, tuple[str, str]]) -> dict[str, bytes]:
    """{path: bytes} of regular files; anything else cannot go in a wheel."""
    data = {}
    for path, (mode, oid) in blobs.items():
        if mode not in ("100644", "100755"):
            raise UserError(
                f"the patched tree's {path} is not a regular "
                f"file (mode {mode}); a wheel cannot carry it"
            )
        data[path] = git("cat-file", "blob", oid, cwd=repo).stdout
    return data


def file_sha256(path: Path) -> str:
    """The hex sha256 of a (large) file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass
class BuiltWheel:
    """The patched wheel written, and what went into it."""

    out: Path
    shipped: dict[str, str]  # path -> A | M | D
    manifest: dict
    timings: dict[str, float]  # unpack, pack: seconds


def build_wheel(
    job: WheelJob,
    tree: PatchedTree,
    src_sha256: str,
    out_dir: Path,
    notes: list[str],
) -> BuiltWheel:
    """Unpack the official wheel, put the patched files and the new version
    in, and pack it into `out_dir` (notes gets what was not shipped)."""
    timings = {}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".apply-wheel-") as tmp:
        t0 = time.monotonic()
        wheel_step(job.python, "unpack", "--dest", str(Path(tmp) / "in"), str(job.src))
        timings["unpack"] = time.monotonic() - t0
        root, info, tops = unpacked_layout(Path(tmp) / "in", job.src)
        shipped = ship_changes(root, tops, tree, notes)
        set_version_py(
            root / "vllm" / "_version.py", job.release, job.version, job.local
        )
        set_wheel_tags(info / "WHEEL", job.name)
        manifest = wheel_manifest(job, tree, src_sha256, shipped, tops)
        (info / WHEEL_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        t0 = time.monotonic()
        out = pack_wheel(job, root, Path(tmp) / "out", out_dir)
        timings["pack"] = time.monotonic() - t0
    return BuiltWheel(out, shipped, manifest, timings)


def unpacked_layout(unpacked: Path, src: Path) -> tuple[Path, Path, set[str]]:
    """The unpacked wheel's root, its one .dist-info, and its other top-level
    names (what the wheel ships)."""
    root = next(unpacked.iterdir())
    infos = [d for d in root.iterdir() if d.name.endswith(".dist-info")]
    if len(infos) != 1:
        raise UserError(f"{src.name}: expected one .dist-info directory")
    tops = {d.name for d in root.iterdir()} - {infos[0].name}
    return root, infos[0], tops


def ship_changes(
    root: Path, tops: set[str], tree: PatchedTree, notes: list[str]
) -> dict[str, str]:
    """The patched tree's changes written into the unpacked wheel where it
    ships them: {path: A | M | D}; the others go to notes."""
    shipped = {}
    for path, status in sorted(tree.changes.items()):
        if PurePosixPath(path).parts[0] not in tops:
            notes.append(f"not in the wheel (not shipped): {path}")
            continue
        target = root / path
        if status in ("M", "D") and not target.is_file():
            notes.append(f"the official wheel lacks {path} ({status})")
        if status == "D":
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tree.data[path])
            target.chmod(0o755 if tree.new[path][0] == "100755" else 0o644)
        shipped[path] = status
    return shipped


def wheel_manifest(
    job: WheelJob,
    tree: PatchedTree,
    src_sha256: str,
    shipped: dict[str, str],
    tops: set[str],
) -> dict:
    """The wheel's vllm_patches.json: what it is made of."""
    base = job.base
    manifest = {
        "tool": "apply.py wheel",
        "version": job.version,
        "release": job.release,
        "stack": job.stack.name,
        "series_sha256": job.series.digest(job.stack),
        "base": {
            "rev": base.rev,
            "commit": base.commit,
            "upstream_commit": base.upstream_commit,
        },
        "from_wheel": {"file": job.src.name, "sha256": src_sha256},
        "patches": [
            {
                "file": p.file,
                "subject": p.subject,
                "upstream_status": (p.values("Upstream-Status") or [""])[0],
                "files": p.files,
            }
            for p in job.patches
        ],
        "files": shipped,
        # what status --installed compares the installed files with
        "file_hashes": {
            path: h
            for path, h in tree.hashes.items()
            if PurePosixPath(path).parts[0] in tops
        },
    }
    if base.assembled:  # the pinned files it ships besides the patches
        manifest["assembled"] = base.assembled
    return manifest


def pack_wheel(job: WheelJob, root: Path, dest: Path, out_dir: Path) -> Path:
    """`wheel pack` of the unpacked tree with the local version, moved to
    `out_dir` under the official wheel's tags."""
    name = job.name
    pack = ["pack", "--dest-dir", str(dest), "--local-version", job.local]
    if name["build"]:
        pack += ["--build-number", name["build"]]
    dest.mkdir()
    wheel_step(job.python, *pack, str(root))
    built = list(dest.glob("*.whl"))
    build = f"-{name['build']}" if name["build"] else ""
    want = f"vllm-{job.version}{build}-{name['py']}-{name['abi']}-{name['plat']}.whl"
    if len(built) != 1 or built[0].name != want:
        raise UserError(f"wheel pack wrote {[b.name for b in built]}, expected {want}")
    out = out_dir / want
    os.replace(built[0], out)
    return out


def report_wheel(
    job: WheelJob,
    built: BuiltWheel,
    notes: list[str],
    seconds: float,
    src_size: int,
    json_path: str | None,
) -> None:
    """What was built, printed; and as JSON where --json says."""
    out, shipped, timings = built.out, built.shipped, built.timings
    size = out.stat().st_size
    delta = size - src_size
    print(out)
    print(
        f"  vllm {job.version}: stack {job.stack.name} ({len(job.patches)} "
        f"patch(es)) on {job.base.rev} ({job.base.commit[:12]}), from {job.src.name}"
    )
    for path, status in shipped.items():
        print(f"    {status} {path}")
    for n in notes:
        print(f"  {n}")
    print(
        f"  built in {seconds:.1f} s (wheel unpack {timings['unpack']:.1f} s, "
        f"wheel pack {timings['pack']:.1f} s); size {src_size} -> {size} "
        f"bytes ({delta:+d} B, {100 * delta / src_size:+.4f}%)"
    )
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "wheel": str(out),
                    "version": job.version,
                    "from_wheel": str(job.src),
                    "seconds": round(seconds, 2),
                    "unpack_seconds": round(timings["unpack"], 2),
                    "pack_seconds": round(timings["pack"], 2),
                    "size": size,
                    "from_size": src_size,
                    "size_delta": delta,
                    "files": shipped,
                    "notes": notes,
                    "manifest": built.manifest,
                },
                indent=2,
            )
            + "\n"
        )


def add_wheel_options(p: argparse.ArgumentParser) -> None:
    """What makes a patched wheel: `wheel`'s options, `image`'s too."""
    common(p, "base", helps={"base": "base release vX.Y.Z (default: the stack's pin)"})
    p.add_argument(
        "--from-wheel",
        metavar="FILE",
        help="the official wheel (default: from the tool's cache, "
        "else downloaded with pip)",
    )
    p.add_argument(
        "--out", default="dist", help="the patched wheel's folder (default: ./dist)"
    )
    common(p, "stack", "repo", "python", "offline", "json", "fetched")
