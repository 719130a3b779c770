#!/usr/bin/env python3
"""Smoke check of a serving image with the patched vLLM wheel (build time).

    python3 image-smoke.py /tmp/vllm-patched/vllm-0.20.2+tq.<hash>-....whl

Run by ci/Dockerfile.serving right after `pip install --no-deps` of that
wheel. Against the wheel file it checks that:

1. the installed vllm distribution and ``vllm.__version__`` are the wheel's
   version (a local version naming the series, e.g. 0.20.2+tq.1a2b3c4d);
2. every file the series changed or added (listed by apply.py wheel in the
   wheel's .dist-info/vllm_patches.json) is installed with the sha256 the
   wheel's RECORD gives, and every file it deleted is gone;
3. the patched modules import, from those installed files. A module that
   needs a package this image does not have (e.g. a ROCm-only module in a
   CUDA image) is reported and not counted as a failure.

Standard library only. Exit 0: ok; 1: a check failed; 2: bad usage.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import importlib.metadata as md
import io
import json
import sys
import zipfile
from pathlib import Path

MANIFEST = "vllm_patches.json"


def sha256_record(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def read_wheel(whl: Path) -> tuple[str, dict, dict[str, str]]:
    """The wheel's version, its apply.py manifest, and RECORD's hashes."""
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
        with zf.open(f"{info}/RECORD") as fh:
            rows = csv.reader(io.TextIOWrapper(fh, encoding="utf-8", newline=""))
            record = {r[0]: r[1] for r in rows if r}
    return version, manifest, record


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].endswith(".whl"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("usage: image-smoke.py WHEEL (exactly one .whl)", file=sys.stderr)
        return 2
    whl = Path(argv[0])
    version, manifest, record = read_wheel(whl)
    failed: list[str] = []
    notes: list[str] = []

    dist = md.distribution("vllm")
    if dist.version != version:
        failed.append(f"installed vllm is {dist.version}, the wheel {version}")
    import vllm

    if vllm.__version__ != version:
        failed.append(f"vllm.__version__ is {vllm.__version__}, not {version}")

    files = manifest["files"]
    for path, status in files.items():
        installed = Path(str(dist.locate_file(path)))
        if status == "D":
            if installed.exists():
                failed.append(f"{path}: deleted by the series, still installed")
        elif not installed.is_file():
            failed.append(f"{path}: not installed")
        elif sha256_record(installed) != record.get(path):
            failed.append(f"{path}: installed content differs from the wheel's")

    imported = 0
    for path, status in files.items():
        if failed:  # importing a wrong install proves nothing
            notes.append("patched modules not imported: the install is wrong")
            break
        if status == "D" or not path.endswith(".py") or "/" not in path:
            continue
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        installed = Path(str(dist.locate_file(path))).resolve()
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != "vllm":
                notes.append(f"{name}: not importable in this image "
                             f"(needs {e.name})")
                continue
            failed.append(f"{name}: import failed: {e!r}")
            continue
        except Exception as e:  # noqa: BLE001 - any failure fails the check
            failed.append(f"{name}: import failed: {e!r}")
            continue
        got = Path(mod.__file__ or "").resolve()
        if got != installed:
            failed.append(f"{name}: imported from {got}, not {installed}")
        else:
            imported += 1

    for n in notes:
        print(f"image-smoke: note: {n}")
    for f in failed:
        print(f"image-smoke: FAILED: {f}")
    print(f"image-smoke: vllm {version} (stack {manifest['stack']}, "
          f"{len(manifest['patches'])} patch(es)): {len(files)} file(s) checked, "
          f"{imported} patched modules imported: "
          + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
