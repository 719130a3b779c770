"""apply.py wheel: a patched vLLM wheel from the official release wheel."""

from __future__ import annotations

import argparse
import base64
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
    resolve_base,
    worktree,
)
from .core import (
    BASE_DATE,
    UserError,
    git,
    git_common_dir,
    gout,
    say,
)
from .pinned import fetched_dir
from .runner import PatchResult, apply_stack
from .series import (
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
    t_start = time.monotonic()
    series = parse_series(Path(args.series))
    stack = series.pick_stack(args.stack, args.base)
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
    local = (
        re.sub(r"[^a-z0-9]+", "", stack.name.lower()) + "." + series.digest(stack)[:8]
    )
    version = f"{release}+{local}"

    results = {p.file: PatchResult(p.file) for p in patches}
    with locked(hashlib.sha1(str(git_common_dir(base.repo)).encode()).hexdigest()[:10]):
        wt = worktree(base.repo, f"{stack.name}-wheel", base.commit)
        conflicts = apply_stack(wt, patches, results)
        if conflicts:
            for p in conflicts:
                files = ", ".join(results[p.file].conflict_files) or "?"
                print(f"{p.file}: does not apply on {base.rev} (conflicts in {files})")
            say(
                f"apply.py wheel: {len(conflicts)} patch(es) do not apply on "
                f"{base.rev}; no wheel written"
            )
            return 1
        head = gout("rev-parse", "HEAD", cwd=wt)
        # An assembled base ships its pinned files too: the wheel is the
        # release's, so the changes are counted from the release's tree.
        since = base.assembled["release_commit"] if base.assembled else base.commit
        changes = tree_changes(wt, since, head)
        new = tree_blobs(wt, head, [p for p, s in changes.items() if s != "D"])
        old = tree_blobs(wt, since, [p for p, s in changes.items() if s != "A"])
        data = {}
        for path, (mode, oid) in new.items():
            if mode not in ("100644", "100755"):
                raise UserError(
                    f"the patched tree's {path} is not a regular "
                    f"file (mode {mode}); a wheel cannot carry it"
                )
            data[path] = git("cat-file", "blob", oid, cwd=wt).stdout
        every = sorted({f for p in patches for f in p.files})
        hashes = file_hashes(wt, base.commit, head, every)
    notes = differing_files(src, changes, old, base.rev, args.force)
    src_size = src.stat().st_size
    h = hashlib.sha256()
    with src.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    out_dir = Path(args.out).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    say(
        f"apply.py wheel: {src.name} + stack {stack.name} ({len(patches)} "
        f"patch(es), {len(changes)} file(s)) -> {version}"
    )
    timings = {}
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
            if status in ("M", "D") and not target.is_file():
                notes.append(f"the official wheel lacks {path} ({status})")
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
            "tool": "apply.py wheel",
            "version": version,
            "release": release,
            "stack": stack.name,
            "series_sha256": series.digest(stack),
            "base": {
                "rev": base.rev,
                "commit": base.commit,
                "upstream_commit": base.upstream_commit,
            },
            "from_wheel": {"file": src.name, "sha256": h.hexdigest()},
            "patches": [
                {
                    "file": p.file,
                    "subject": p.subject,
                    "upstream_status": (p.values("Upstream-Status") or [""])[0],
                    "files": p.files,
                }
                for p in patches
            ],
            "files": shipped,
            # what status --installed compares the installed files with
            "file_hashes": {
                path: h
                for path, h in hashes.items()
                if PurePosixPath(path).parts[0] in tops
            },
        }
        if base.assembled:  # the pinned files it ships besides the patches
            manifest["assembled"] = base.assembled
        (infos[0] / WHEEL_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        t0 = time.monotonic()
        pack = ["pack", "--dest-dir", str(Path(tmp) / "out"), "--local-version", local]
        if name["build"]:
            pack += ["--build-number", name["build"]]
        (Path(tmp) / "out").mkdir()
        wheel_step(python, *pack, str(root))
        timings["pack"] = time.monotonic() - t0
        built = list((Path(tmp) / "out").glob("*.whl"))
        build = f"-{name['build']}" if name["build"] else ""
        want = f"vllm-{version}{build}-{name['py']}-{name['abi']}-{name['plat']}.whl"
        if len(built) != 1 or built[0].name != want:
            raise UserError(
                f"wheel pack wrote {[b.name for b in built]}, expected {want}"
            )
        out = out_dir / want
        os.replace(built[0], out)
    seconds = time.monotonic() - t_start
    size = out.stat().st_size
    delta = size - src_size
    print(out)
    print(
        f"  vllm {version}: stack {stack.name} ({len(patches)} patch(es)) on "
        f"{base.rev} ({base.commit[:12]}), from {src.name}"
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
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "wheel": str(out),
                    "version": version,
                    "from_wheel": str(src),
                    "seconds": round(seconds, 2),
                    "unpack_seconds": round(timings["unpack"], 2),
                    "pack_seconds": round(timings["pack"], 2),
                    "size": size,
                    "from_size": src_size,
                    "size_delta": delta,
                    "files": shipped,
                    "notes": notes,
                    "manifest": manifest,
                },
                indent=2,
            )
            + "\n"
        )
    return 0
