#!/usr/bin/env python3
"""Smoke check of a serving image with the patched vLLM wheel (build time).

    python3 <project>/ci/image-smoke.py --base WHEEL   # before the install
    python3 <project>/ci/image-smoke.py WHEEL          # after it

Run by ci/Dockerfile.serving. With --base, before `pip install --no-deps` of
the wheel: the image's own vllm must be the wheel's release, unpatched (a
wheel of another release would replace it with files that do not fit the
rest of the image). Then, right after the install, from the copy of the
project the build was given (apply.py, applylib/, series, patches/), the
check anyone runs on their own environment, `apply.py status --installed`,
run inside the image by the image's Python:

1. the installed vllm's files against what the patched wheel recorded of
   itself (.dist-info/vllm_patches.json: every file each patch changes,
   with its patched and its release content): every patch of the stack in
   effect, every changed file as built (the wheel's RECORD), and the
   patched modules import from those files (a module that needs a package
   this image lacks, or Triton with a GPU driver, as UltraQuant's does at
   import, patched or not, is noted and not counted);
2. with --no-tests: the image has no pytest, and no GPU at build time;
3. besides, the installed vllm is that wheel: the same version and the
   same series digest, and the project copy is the series the wheel was
   made from (so no base repository, network or git is needed).

Standard library only. Exit 0: ok; 1: a check failed; 2: bad usage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
MANIFEST = "vllm_patches.json"


def read_wheel(whl: Path) -> tuple[str, dict]:
    """The wheel's version and its apply.py manifest."""
    with zipfile.ZipFile(whl) as zf:
        infos = {n.split("/")[0] for n in zf.namelist()
                 if n.split("/")[0].endswith(".dist-info")}
        if len(infos) != 1:
            raise SystemExit(f"{whl.name}: expected one .dist-info, got {infos}")
        info = infos.pop()
        meta = zf.read(f"{info}/METADATA").decode()
        version = next(ln.split(":", 1)[1].strip() for ln in meta.splitlines()
                       if ln.startswith("Version:"))
        try:
            manifest = json.loads(zf.read(f"{info}/{MANIFEST}"))
        except KeyError:
            raise SystemExit(f"{whl.name}: no {info}/{MANIFEST}: not a wheel "
                             "made by apply.py wheel") from None
    return version, manifest


def series_mismatch(manifest: dict) -> str | None:
    """Why the project copy is not the series the wheel was made from."""
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(PROJECT))
    from applylib.series import parse_series

    series = parse_series(PROJECT / "series")
    stack = next((s for s in series.stacks if s.name == manifest["stack"]), None)
    if stack is None or series.digest(stack) != manifest["series_sha256"]:
        return (f"the project copy's series ({PROJECT / 'series'}) is not the "
                f"one the wheel was made from (stack {manifest['stack']}, "
                f"digest {manifest['series_sha256'][:16]})")
    return None


def base_mismatch(manifest: dict) -> str | None:
    """Why the image's own vllm (before the install) is not the release the
    wheel was made from."""
    from importlib.metadata import PackageNotFoundError, version

    release = manifest["release"]
    try:
        have = version("vllm")
    except PackageNotFoundError:
        have = None
    if have == release:
        return None
    what = f"vllm {have}" if have else "no vllm"
    if have and "+" in have:
        what += " (already patched)"
    return (f"the base image has {what}, the wheel is of release {release}: "
            f"build FROM the vllm/vllm-openai:v{release} image (or an image "
            f"with that release), or make the wheel of the image's release")


def main(argv: list[str]) -> int:
    base = argv[:1] == ["--base"]
    argv = argv[1:] if base else argv
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print("usage: image-smoke.py [--base] WHEEL (exactly one .whl)",
              file=sys.stderr)
        return 2
    whl = Path(argv[0])
    version, manifest = read_wheel(whl)
    if base:
        why = base_mismatch(manifest)
        print(f"image-smoke: FAILED: {why}" if why else
              f"image-smoke: the base image has vllm {manifest['release']}: ok")
        return 1 if why else 0
    why = series_mismatch(manifest)
    if why:  # else status would look for the release's base to judge by
        print(f"image-smoke: FAILED: {why}")
        return 1
    with tempfile.TemporaryDirectory(prefix="image-smoke-") as tmp:
        out = Path(tmp) / "status.json"
        env = dict(os.environ, VLLM_PATCHES_CACHE=str(Path(tmp) / "cache"))
        proc = subprocess.run(
            [sys.executable, "-B", str(PROJECT / "apply.py"), "status",
             "--installed", "--no-tests", "--offline", "--python", sys.executable,
             "--series", str(PROJECT / "series"), "--json", str(out)],
            env=env, cwd=tmp)
        if not out.is_file():
            print(f"image-smoke: FAILED: apply.py status --installed: exit "
                  f"{proc.returncode}, no report")
            return 1
        rep = json.loads(out.read_text())
    failed = []
    if rep["vllm"]["version"] != version:
        failed.append(f"installed vllm is {rep['vllm']['version']}, the wheel "
                      f"{version}")
    wheel = rep.get("wheel") or {}
    if wheel.get("series_sha256") != manifest["series_sha256"]:
        failed.append("the installed vllm was not made from this wheel's series")
    kinds = {st["reference"]["kind"] for st in rep["stacks"]}
    if kinds != {"wheel manifest"}:
        failed.append(f"the project copy ({PROJECT / 'series'}) is not the "
                      "series the wheel was made from")
    if proc.returncode != 0:
        failed.append(f"apply.py status --installed: exit {proc.returncode}")
    for f in failed:
        print(f"image-smoke: FAILED: {f}")
    patches = [p for st in rep["stacks"] for p in st["patches"]]
    print(f"image-smoke: vllm {version} (stack {manifest['stack']}, "
          f"{len(patches)} patch(es)): "
          f"{sum(p['installed'] == 'in-effect' for p in patches)} in effect, "
          f"{wheel.get('as_built', 0)} of {wheel.get('files', 0)} file(s) as "
          f"built, {len(rep['imports']['ok'])} patched module(s) imported: "
          + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
