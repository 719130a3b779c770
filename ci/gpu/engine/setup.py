"""Apply one carry of ci/gpu/stage.py's release stage on the device (run.sh's
engine part runs it before the jobs):

    python3 ci/gpu/engine/setup.py --carry .dev/eng/c3

CARRY/manifest.json names the carries that must have been applied on this
machine before (their markers in ROOT/markers; missing: the machine was
given back since, "STAGE LOST", exit 20), the parts in CARRY (each checked
by sha256, exit 31, and kept in ROOT/parts) and what this carry completes: an
xz tar (its parts joined, checked by sha256, exit 32) unpacked into
ROOT/rel/REL, ROOT/deps or, for a variant REL+VARIANT, over a hard-linked
copy of rel/REL. A completed tree gets .complete (the driver runs jobs only
on those). A carry applied before is skipped, so a call can be re-run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("ENG_ROOT", "/root/eng"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def die(code: int, msg: str) -> None:
    print(msg, flush=True)
    sys.exit(code)


def build(b: dict) -> None:
    """One stream: the parts joined, checked, unpacked into its tree."""
    stream = ROOT / "tmp" / f"{b['name']}.tar.xz"
    stream.parent.mkdir(parents=True, exist_ok=True)
    with open(stream, "wb") as out:
        for p in b["parts"]:
            with open(ROOT / "parts" / p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(stream) != b["sha256"]:
        die(32, f"[setup] {b['name']}: sha256 mismatch")
    dest = ROOT / b["dest"]
    shutil.rmtree(dest, ignore_errors=True)
    if "base" in b:  # a variant: the release's files hard-linked, its own copied
        subprocess.run(["cp", "-al", str(ROOT / b["base"]), str(dest)], check=True)
        for name in b["files"]:
            (dest / name).unlink(missing_ok=True)  # never write through a link
            for pyc in (dest / name).parent.glob(f"__pycache__/{Path(name).stem}.*.pyc"):
                pyc.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(stream) as tf:
        tf.extractall(dest, filter="fully_trusted")
    stream.unlink()
    if b["dest"].startswith("rel/"):
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(dest)],
                       stdout=subprocess.DEVNULL)  # fmt: skip
        (dest / ".complete").write_text(time.strftime("%FT%TZ", time.gmtime()) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", required=True)
    carry = Path(ap.parse_args().carry)
    if not (carry / "manifest.json").exists():
        print(f"[setup] no carry at {carry}: nothing to apply")
        return 0
    man = json.loads((carry / "manifest.json").read_text())
    markers = ROOT / "markers"
    markers.mkdir(parents=True, exist_ok=True)
    lost = [r for r in man["requires"] if not (markers / r).exists()]
    if lost:
        die(20, f"STAGE LOST: {man['call']} needs {lost} applied on this machine "
                "first (a fresh machine): start again at the first carry")  # fmt: skip
    if (markers / man["call"]).exists():
        print(f"[setup] {man['call']} applied on this machine before")
        return 0
    t0 = time.time()
    (ROOT / "parts").mkdir(exist_ok=True)
    for p in man["parts"]:
        if sha256(carry / p["file"]) != p["sha256"]:
            die(31, f"[setup] part {p['file']} corrupt (sha256)")
        shutil.copyfile(carry / p["file"], ROOT / "parts" / p["file"])
    for b in man["builds"]:
        t = time.time()
        build(b)
        print(f"[setup] {b['name']}: ok in {time.time() - t:.1f} s", flush=True)
        for p in b["parts"]:
            (ROOT / "parts" / p).unlink()
    (markers / man["call"]).write_text(time.strftime("%FT%TZ", time.gmtime()) + "\n")
    done = sorted(p.parent.name for p in ROOT.glob("rel/*/.complete"))
    print(f"[setup] {man['call']} applied in {time.time() - t0:.1f} s; complete: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
