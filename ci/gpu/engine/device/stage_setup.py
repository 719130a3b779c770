"""Apply one carry folder on the device (call.sh runs it first in every call):

    python3 ci/gpu/engine/device/stage_setup.py --carry .dev/eng/c3

Reads CARRY/manifest.json (written by build_stage.py):
  requires  carries that must already have been applied on this machine
            (their marker files in /root/eng/markers); if one is missing the
            machine was recycled since: prints "STAGE LOST" and exits 20
  parts     compressed pieces in CARRY, each checked against its sha256 and
            copied to /root/eng/parts (exit 31 on a mismatch)
  builds    what this carry completes, in order:
            tar      parts -> zstd -d [--patch-from an earlier tar kept in
                     /root/eng/store] -> tar checked by sha256 -> extracted
            file     parts -> zstd -d [--patch-from earlier release files] ->
                     the compiled file, checked by the wheel's sha256 (exit 32)
            complete all files of a release present: compileall, marker
                     rel/REL/.complete
            variant  rel/REL+VARIANT = hard-linked copy of rel/REL with the
                     overlay's files replaced (each checked by sha256)
Then touches /root/eng/markers/CALL. A carry already applied is skipped (a
call may be re-run on the same machine to redo its scenarios).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("ENG_ROOT", "/root/eng"))


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()


def die(code: int, msg: str) -> None:
    print(msg, flush=True)
    sys.exit(code)


def have_zstd_cli() -> bool:
    if os.environ.get("ENG_FORCE_PYZSTD"):  # dry runs of the fallback
        return False
    return shutil.which("zstd") is not None


def decompress_py(parts: list[str], out: Path, ref: Path | None) -> None:
    """Fallback without the zstd command: python-zstandard from the wheel
    carried raw in c1 (a --patch-from reference is a raw-content dictionary)."""
    # ENG_ZSTDPY: another python-zstandard (dry runs here: the carried wheel is cp312)
    sys.path.insert(0, os.environ.get("ENG_ZSTDPY", str(ROOT / "zstdpy")))
    import zstandard as zs

    kw: dict = {"max_window_size": 2**31}
    if ref is not None:
        kw["dict_data"] = zs.ZstdCompressionDict(
            ref.read_bytes(), dict_type=zs.DICT_TYPE_RAWCONTENT
        )
    d = zs.ZstdDecompressor(**kw)

    class Cat:
        def __init__(self, files):
            self.files = [open(f, "rb") for f in files]

        def read(self, n=-1):
            while self.files:
                b = self.files[0].read(n)
                if b:
                    return b
                self.files.pop(0).close()
            return b""

    with open(out, "wb") as o:
        r = d.stream_reader(
            Cat([ROOT / "parts" / p for p in parts]), read_across_frames=True
        )
        while True:
            b = r.read(1 << 22)
            if not b:
                break
            o.write(b)


def decompress(parts: list[str], out: Path, refs: list[Path]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    ref = None
    if refs:
        if len(refs) == 1:
            ref = refs[0]
        else:
            ref = ROOT / "tmp" / "ref.bin"
            ref.parent.mkdir(parents=True, exist_ok=True)
            with open(ref, "wb") as o:
                for r in refs:
                    with open(r, "rb") as i:
                        shutil.copyfileobj(i, o, 1 << 22)
    if have_zstd_cli():
        cmd = ["zstd", "-q", "-d", "-f", "--long=31", "-o", str(out)]
        if ref is not None:
            cmd.append(f"--patch-from={ref}")
        cat = subprocess.Popen(
            ["cat", *[str(ROOT / "parts" / p) for p in parts]], stdout=subprocess.PIPE
        )
        rc = subprocess.run(cmd, stdin=cat.stdout).returncode
        cat.wait()
    else:
        try:
            decompress_py(parts, out, ref)
            rc = 0
        except Exception as e:  # noqa: BLE001
            print(f"[setup] python-zstandard failed: {e!r}")
            rc = 1
    if ref is not None and len(refs) > 1:
        ref.unlink()
    if rc != 0:
        die(33, f"zstd failed ({rc}) for {out}")


def stamp_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n"


def build_raw(b: dict) -> None:
    """Parts concatenated as they are (the zstandard wheel, unpacked for
    the fallback decompression)."""
    dest = ROOT / b["dest"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as o:
        for p in b["parts"]:
            with open(ROOT / "parts" / p, "rb") as i:
                shutil.copyfileobj(i, o, 1 << 22)
    if sha256(dest) != b["sha256"]:
        die(32, f"[setup] {b['name']}: sha256 mismatch")
    if b["name"] == "zstandard-wheel":
        import zipfile

        with zipfile.ZipFile(dest) as z:
            z.extractall(ROOT / "zstdpy")
        version = ""
        if have_zstd_cli():
            zv = subprocess.run(["zstd", "--version"], capture_output=True, text=True)
            version = f" ({zv.stdout.strip()})"
        found = shutil.which("zstd") or "MISSING: using python-zstandard"
        print(f"[setup] zstd command: {found}{version}", flush=True)


def build_tar(b: dict) -> None:
    """A tar (a delta against an earlier one kept in the store) extracted
    into its destination."""
    store = ROOT / "store"
    store.mkdir(parents=True, exist_ok=True)
    tar = store / (b.get("store") or f"{b['name']}.tar")
    refs = [store / r for r in b.get("ref_store", [])]
    decompress(b["parts"], tar, refs)
    if sha256(tar) != b["tar_sha256"]:
        die(32, f"[setup] {b['name']}: tar sha256 mismatch")
    dest = ROOT / b["dest"]
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xf", str(tar), "-C", str(dest)], check=True)
    if not b.get("keep_tar"):
        tar.unlink()


def build_file(b: dict) -> None:
    """A compiled file (a delta against earlier releases' files)."""
    out = ROOT / b["dest"]
    decompress(b["parts"], out, [ROOT / r for r in b.get("ref", [])])
    if sha256(out) != b["sha256"]:
        die(32, f"[setup] {b['name']}: sha256 mismatch after decompression")


def build_complete(b: dict) -> None:
    """A release with every file it needs: byte-compiled and marked."""
    rel = ROOT / "rel" / b["release"]
    miss = [r for r in b["requires"] if not (ROOT / r).exists()]
    if miss:
        die(34, f"[setup] {b['release']}: missing {miss}")
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "16", str(rel / "vllm")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (rel / ".wheel_sha256").write_text(b["wheel_sha256"] + "\n")
    (rel / ".complete").write_text(stamp_text())


def build_variant(b: dict) -> None:
    """REL+VARIANT: a hard-linked copy of the release with the overlay's
    files replaced (never written through the links)."""
    base = ROOT / "rel" / b["release"]
    dst = ROOT / "rel" / f"{b['release']}+{b['variant']}"
    if not (base / ".complete").exists():
        die(34, f"[setup] variant {b['name']}: base {base} not complete")
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["cp", "-al", str(base), str(dst)], check=True)
    (dst / ".complete").unlink(missing_ok=True)
    changed = [overlay_file(b, f, dst) for f in b["files"]]
    for rp in b.get("meta", {}).get("removed", []):
        (dst / rp).unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *changed],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (dst / ".variant.json").write_text(json.dumps(b, indent=1))
    (dst / ".complete").write_text(stamp_text())


def overlay_file(b: dict, f: dict, dst: Path) -> str:
    src = ROOT / "overlays" / b["name"] / f["path"]
    if sha256(src) != f["sha256"]:
        die(32, f"[setup] overlay file {f['path']} sha256 mismatch")
    target = dst / f["path"]
    if target.exists():
        target.unlink()  # a hard link to the release's file: never write through it
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    pyc_dir = target.parent / "__pycache__"
    if pyc_dir.is_dir():
        for pyc in pyc_dir.glob(target.stem + ".*.pyc"):
            pyc.unlink()
    return str(target)


BUILDERS = {
    "raw": build_raw,
    "tar": build_tar,
    "file": build_file,
    "complete": build_complete,
    "variant": build_variant,
}


def check_requires(man: dict, markers: Path) -> bool:
    """Whether the carry is still to apply: exit 20 if an earlier carry is
    missing on this machine; False if this one was applied already."""
    call = man["call"]
    missing = [r for r in man["requires"] if not (markers / r).exists()]
    if missing:
        die(
            20,
            f"STAGE LOST: {call} needs {missing} applied on this machine first "
            "(the machine was given back and a fresh one started): restart the "
            "campaign at c1",
        )
    if (markers / call).exists():
        print(f"[setup] {call} already applied on this machine; nothing to do")
        return False
    return True


def copy_parts(carry: Path, man: dict, t0: float) -> None:
    """Every part checked against its sha256 and copied out of the carry."""
    (ROOT / "parts").mkdir(parents=True, exist_ok=True)
    for p in man["parts"]:
        src = carry / p["file"]
        if not src.exists() or sha256(src) != p["sha256"]:
            die(31, f"[setup] part {p['file']} missing or corrupt (sha256 mismatch)")
        shutil.copyfile(src, ROOT / "parts" / p["file"])
    mib = sum(p["bytes"] for p in man["parts"]) / 2**20
    print(
        f"[setup] {man['call']}: {len(man['parts'])} parts verified "
        f"({mib:.1f} MiB) in {time.time() - t0:.1f} s",
        flush=True,
    )


def apply_builds(builds: list[dict]) -> list[str]:
    """Each build in order (those stamped by an earlier, partial setup are
    done); the parts of those built now."""
    stamps = ROOT / "stamps"
    stamps.mkdir(parents=True, exist_ok=True)
    done_parts: list[str] = []
    for b in builds:
        t = time.time()
        k = b["kind"]
        stamp = stamps / b["name"].replace("/", "_").replace(":", "_")
        if stamp.exists():  # a re-run after a partial setup: this build is done
            print(f"[setup] {k:8s} {b['name']}: done earlier", flush=True)
            continue
        if k in BUILDERS:
            BUILDERS[k](b)
        stamp.write_text(stamp_text())
        print(f"[setup] {k:8s} {b['name']}: ok in {time.time() - t:.1f} s", flush=True)
        done_parts += b.get("parts", [])
    return done_parts


DEPS_MODULES = [
    "pydantic",
    "pydantic_core",
    "msgspec",
    "zmq",
    "cbor2",
    "pybase64",
    "blake3",
    "openai",
    "openai_harmony",
    "fastapi",
    "starlette",
    "xgrammar",
    "llguidance",
    "partial_json_parser",
    "setproctitle",
    "cachetools",
    "gguf",
    "compressed_tensors",
    "tvm_ffi",
]


def check_deps() -> None:
    """The staged dependencies byte-compiled, and imported on their own
    (cp312 wheels: only meaningful on the device)."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "16", str(ROOT / "deps")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if sys.version_info[:2] != (3, 12):
        print(
            f"[setup] deps import check skipped (Python {sys.version.split()[0]}; "
            "the wheels are cp312)"
        )
        return
    code = (
        "import importlib,sys\nbad=[]\nfor m in sys.argv[1:]:\n"
        "    try: importlib.import_module(m)\n"
        "    except Exception as e: bad.append(f'{m}: {e!r}'[:200])\n"
        "print('[setup] deps import check:', 'ok' if not bad else bad)"
    )
    env = dict(
        os.environ, PYTHONPATH=str(ROOT / "deps"), TVM_FFI_DISABLE_TORCH_C_DLPACK="1"
    )
    subprocess.run([sys.executable, "-c", code, *DEPS_MODULES], env=env)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--carry", required=True)
    a = ap.parse_args()
    t0 = time.time()
    carry = Path(a.carry)
    if not (carry / "manifest.json").exists():
        print(f"[setup] no carry at {carry}: nothing to apply")
        return 0
    man = json.loads((carry / "manifest.json").read_text())
    markers = ROOT / "markers"
    markers.mkdir(parents=True, exist_ok=True)
    if not check_requires(man, markers):
        return 0
    copy_parts(carry, man, t0)
    done_parts = apply_builds(man["builds"])
    if any(b["kind"] == "tar" and b["dest"] == "deps" for b in man["builds"]):
        check_deps()
    (markers / man["call"]).write_text(stamp_text())
    for p in done_parts:  # only now: a failed setup can be re-run with every part
        (ROOT / "parts" / p).unlink(missing_ok=True)
    rel = ROOT / "rel"
    done = rel.glob("*") if rel.exists() else []
    trees = sorted(p.name for p in done if (p / ".complete").exists())
    print(
        f"[setup] {man['call']} applied in {time.time() - t0:.1f} s; "
        f"complete trees: {trees}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
