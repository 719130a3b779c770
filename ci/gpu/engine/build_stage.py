"""Build what the GPU campaign carries to the device, from the vLLM release
wheels (run HERE, from the repository root):

    python3 ci/gpu/engine/build_stage.py \
        --releases v0.20.2,v0.22.0,v0.26.0 \
        --overlay v0.20.2:patched=/work/stage/patched/vllm-0.20.2+tq.*.whl \
        [--overlay v0.26.0:patched=DIR_WITH_vllm/] [--dist DIR] [--work /work/stage]

Per release (generic): the wheel's Python part as a tar (no compiled files,
no C++ headers of third_party/, no vllm-rs binary, no __pycache__), and the
compiled parts the engine needs on a CUDA GPU:
  - vllm/_C.abi3.so where the wheel has it (platforms/cuda.py imports it
    unconditionally up to v0.23), vllm/_C_stable_libtorch.abi3.so (always
    imported), vllm/cumem_allocator.abi3.so, vllm/spinloop.abi3.so (cheap);
  - vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so: EngineArgs forces
    flash_attn_version=2 for every turboquant_* KV dtype (checked in the
    release's engine/arg_utils.py; FA3 is added when a release stops forcing
    it, or with --fa3);
  - not _moe_C (its import is suppressed on failure; dense/hybrid models
    without experts never call it), not _flashmla*, _qutlass_C, deep_gemm.
Every compiled file is compressed with zstd -19: either alone (--long) or
as a delta (--patch-from) against a file staged for an earlier release (the
same path, or for _C_stable_libtorch the concatenation of the earlier _C and
_C_stable_libtorch), whichever is smaller (ranked at -3, final at -19). The
later releases' Python tars are deltas against the previous release's tar.

One set of import-time dependencies (cp312 manylinux wheels in
WORK/deps/whl, unpacked flat) serves every staged release.

Overlays: a variant of a release whose files replace some of the release's
(--overlay REL:VARIANT=SOURCE). SOURCE is a wheel (the files whose RECORD
hash differs from the release wheel's: `apply.py wheel`'s patched wheel) or
a directory holding vllm/... (a port). A compiled file in an overlay is
refused.

Everything is cut into carry folders .dev/eng/c1, c2, ... of at most
--budget MiB, in order: the first release complete first (its small items,
then the large ones), then the next. A compressed stream may span two
carries. Each carry holds manifest.json for device/stage_setup.py: parts
with sha256, and the builds this carry completes (files with their final
sha256). The script fails (exit 3) if a carry, or a carry plus the files of
the working tree that travel with every call (tracked and untracked, not
ignored), reaches 64 MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import glob
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MiB = 1 << 20
LIMIT = 64 * MiB  # the device tool's working-tree limit
DEFAULT_DIST = (
    Path(os.environ.get("VLLM_PATCHES_CACHE", Path.home() / ".cache/vllm-patches"))
    / "dist"
)

PY_EXCLUDE = (
    "*.so",
    "*/__pycache__/*",
    "vllm/third_party/*.h",
    "vllm/third_party/*.hpp",
    "vllm/third_party/*.cuh",
    "vllm/third_party/*.inl",
    "vllm/third_party/*.cu",
    "vllm/third_party/*.cpp",
    "vllm/vllm-rs",
    "vllm/entrypoints/serve/instrumentator/static/*",
)
SO_ALWAYS = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/cumem_allocator.abi3.so",
)
SO_IF_PRESENT = ("vllm/_C.abi3.so", "vllm/spinloop.abi3.so")
FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"


def log(*a) -> None:
    print(*a, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def find_wheel(dist: Path, rel: str) -> Path:
    v = rel.lstrip("v")
    cands = [Path(p) for p in glob.glob(str(dist / f"vllm-{v}-*.whl"))]
    cands = [p for p in cands if "+" not in p.name]
    if not cands:
        raise SystemExit(f"build_stage: no wheel for {rel} in {dist}")
    return sorted(cands)[0]


# --------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------


def extract_release(whl: Path, work: Path, rel: str) -> dict:
    """Python tree -> WORK/trees/REL (all non-.so files), compiled files ->
    WORK/so/REL; cached by the wheel's sha256."""
    tree = work / "trees" / rel
    sodir = work / "so" / rel
    stamp = work / "trees" / f"{rel}.wheel.sha256"
    wsha = sha256(whl)
    if not (stamp.exists() and stamp.read_text().strip() == wsha):
        log(f"[extract] {whl.name}")
        shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(sodir, ignore_errors=True)
        tree.mkdir(parents=True)
        sodir.mkdir(parents=True)
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.endswith("/"):
                    continue
                dest = (sodir if n.endswith(".so") else tree) / n
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(n) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        stamp.write_text(wsha + "\n")
    return {"wheel": str(whl), "wheel_sha256": wsha, "tree": tree, "so": sodir}


def needed_so(rel: str, info: dict, want_fa3: bool) -> tuple[list[str], dict]:
    sodir: Path = info["so"]
    tree: Path = info["tree"]
    notes = {}
    files = [p for p in SO_IF_PRESENT if (sodir / p).exists()] + [p for p in SO_ALWAYS]
    for p in files:
        if not (sodir / p).exists():
            raise SystemExit(f"build_stage: {rel} wheel lacks {p}")
    cuda_py = (tree / "vllm/platforms/cuda.py").read_text()
    top = [
        ln.strip()
        for ln in cuda_py.splitlines()[:60]
        if re.match(r"^import vllm\._", ln)
    ]
    notes["platforms/cuda.py module-level imports"] = top
    arg = (tree / "vllm/engine/arg_utils.py").read_text()
    forced = (
        "TurboQuant is not yet compatible with FlashAttention >= 3" in arg
        and "flash_attn_version = 2" in arg
    )
    notes["turboquant forces FA2"] = forced
    if want_fa3 or not forced:
        files.append(FA3)
    notes["moe import"] = (
        "suppressed (contextlib.suppress / try)"
        if ("suppress(ImportError)" in cuda_py or "_moe_C" not in cuda_py)
        else "check"
    )
    return files, notes


def py_tar(tree: Path, out: Path) -> Path:
    """Deterministic tar of the Python part (see PY_EXCLUDE)."""
    if out.exists():
        return out
    names = []
    for root, dirs, fs in os.walk(tree):
        dirs.sort()
        for f in sorted(fs):
            rp = os.path.relpath(os.path.join(root, f), tree)
            if any(fnmatch.fnmatch(rp, pat) for pat in PY_EXCLUDE):
                continue
            names.append(rp)
    tmp = out.with_suffix(".tmp")
    write_tar(tmp, tree, names)
    tmp.replace(out)
    return out


def write_tar(out: Path, root: Path, names: list[str]) -> None:
    """A deterministic tar of ``names`` under ``root`` (no times, no owners)."""
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tf:
        for rp in names:
            ti = tf.gettarinfo(str(root / rp), arcname=rp)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
            with open(root / rp, "rb") as f:
                tf.addfile(ti, f)


def deps_tar(whl_dir: Path, out: Path) -> tuple[Path, list[str]]:
    wheels = sorted(whl_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"build_stage: no dependency wheels in {whl_dir} (see ci/gpu/README.md)"
        )
    key = sha256_bytes(
        "\n".join(f"{w.name}:{w.stat().st_size}" for w in wheels).encode()
    )[:16]
    out = out.with_name(f"deps-{key}.tar")
    if not out.exists():
        site = out.with_suffix(".site")
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        for a in site.rglob("*.a"):  # static libraries are never loaded at run time
            a.unlink()
        names = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
        write_tar(out, site, names)
        shutil.rmtree(site)
    return out, [w.name for w in wheels]


def wheel_record(z: zipfile.ZipFile) -> dict[str, str]:
    """A wheel's RECORD: path -> hash."""
    rec = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    out = {}
    for ln in z.read(rec).decode().splitlines():
        parts = ln.rsplit(",", 2)
        if len(parts) == 3:
            out[parts[0]] = parts[1]
    return out


def wheel_overlay(
    release_wheel: str, p: Path, src: str, meta: dict
) -> dict[str, bytes]:
    """The vllm/ files whose RECORD hash differs from the release wheel's
    (`meta` gets what else differs: removed files, dist-info, version)."""
    files: dict[str, bytes] = {}
    meta["wheel_sha256"] = sha256(p)
    with zipfile.ZipFile(release_wheel) as a, zipfile.ZipFile(p) as b:
        ra, rb = wheel_record(a), wheel_record(b)
        for n, h in rb.items():
            if n.endswith("RECORD") or ra.get(n) == h:
                continue
            if n.startswith("vllm/"):
                if n.endswith(".so"):
                    raise SystemExit(f"build_stage: overlay {src} changes compiled {n}")
                files[n] = b.read(n)
        removed = [
            n
            for n in ra
            if n not in rb and n.startswith("vllm/") and ".dist-info" not in n
        ]
        if removed:
            meta["removed"] = removed
        meta["changed_dist_info"] = sorted(
            n
            for n in rb
            if ".dist-info/" in n and ra.get(n) != rb[n] and not n.endswith("RECORD")
        )
        metadata = next(n for n in b.namelist() if n.endswith(".dist-info/METADATA"))
        ver = re.search(rb"^Version: (.+)$", b.read(metadata), re.M)
        meta["version"] = ver.group(1).decode().strip() if ver else "?"
    return files


def dir_overlay(tree: Path, p: Path, src: str) -> dict[str, bytes]:
    """The files of a directory holding vllm/... that differ from the tree's."""
    files: dict[str, bytes] = {}
    base = p if (p / "vllm").is_dir() else p.parent
    for f in sorted((base / "vllm").rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            rp = str(f.relative_to(base))
            if rp.endswith(".so"):
                raise SystemExit(f"build_stage: overlay {src} holds compiled {rp}")
            orig = tree / rp
            data = f.read_bytes()
            if orig.exists() and orig.read_bytes() == data:
                continue
            files[rp] = data
    return files


def overlay_files(
    rel: str, rel_info: dict, src: str, work: Path, name: str
) -> tuple[Path, list[dict], dict]:
    """Files of an overlay, as a tar of vllm/... paths, plus their list."""
    meta: dict = {"source": src}
    p = Path(src)
    if p.is_file() and p.suffix == ".whl":
        files = wheel_overlay(rel_info["wheel"], p, src, meta)
    elif p.is_dir():
        files = dir_overlay(rel_info["tree"], p, src)
    else:
        raise SystemExit(
            f"build_stage: overlay source {src} is neither a wheel nor a directory"
        )
    if not files:
        raise SystemExit(f"build_stage: overlay {src} changes nothing in {rel}")
    out = work / "stage" / f"overlay-{rel}-{name}.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for rp in sorted(files):
            ti = tarfile.TarInfo(rp)
            ti.size, ti.mode, ti.mtime = len(files[rp]), 0o644, 0
            tf.addfile(ti, io.BytesIO(files[rp]))
    out.write_bytes(buf.getvalue())
    lst = [
        {"path": rp, "sha256": sha256_bytes(d), "bytes": len(d)}
        for rp, d in sorted(files.items())
    ]
    return out, lst, meta


# --------------------------------------------------------------------------
# compression
# --------------------------------------------------------------------------


def zstd(src: Path, out: Path, level: int, ref: Path | None, threads: int) -> None:
    size = src.stat().st_size + (ref.stat().st_size if ref else 0)
    wlog = max(27, math.ceil(math.log2(max(size, 1))))
    cmd = ["zstd", "-q", "-f", f"-{level}", f"--long={wlog}", f"-T{threads}"]
    if level > 19:
        cmd.insert(3, "--ultra")
    if ref is not None:
        cmd.append(f"--patch-from={ref}")
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(["nice", "-n", "10", *cmd, str(src), "-o", str(tmp)], check=True)
    tmp.replace(out)


def compress(
    src: Path, refs: list[tuple[str, list[Path]]], zdir: Path, level: int, threads: int
) -> dict:
    """Best of: full, or a delta against each candidate reference (a list of
    files, concatenated). Ranked at -3, final at `level`; cached by content."""
    zdir.mkdir(parents=True, exist_ok=True)
    ssha = sha256(src)
    cands: list[tuple[str, list[Path]]] = [("full", [])] + [r for r in refs if r[1]]
    ranked = []
    for label, files in cands:
        rkey = (
            "full"
            if not files
            else sha256_bytes("".join(sha256(f) for f in files).encode())[:16]
        )
        ref = None
        if files:
            ref = zdir / f"ref-{rkey}.bin"
            if not ref.exists():
                with open(ref.with_suffix(".tmp"), "wb") as o:
                    for f in files:
                        with open(f, "rb") as i:
                            shutil.copyfileobj(i, o, 1 << 22)
                ref.with_suffix(".tmp").replace(ref)
        quick = zdir / f"{ssha[:16]}-{rkey}-L3.zst"
        if not quick.exists():
            zstd(src, quick, 3, ref, threads)
        ranked.append((quick.stat().st_size, label, files, rkey, ref))
    ranked.sort(key=lambda x: x[0])
    qsize, label, files, rkey, ref = ranked[0]
    final = zdir / f"{ssha[:16]}-{rkey}-L{level}.zst"
    if (
        qsize < 4 * MiB
    ):  # already small: -19 over a large reference costs minutes for little
        final = zdir / f"{ssha[:16]}-{rkey}-L3.zst"
    if not final.exists():
        t = time.time()
        log(f"[zstd] {src.name} {label} -{level} (quick {qsize / MiB:.1f} MiB) ...")
        zstd(src, final, level, ref, threads)
        log(
            f"[zstd]   -> {final.stat().st_size / MiB:.2f} MiB in {time.time() - t:.0f} s"
        )
    return {
        "src_sha256": ssha,
        "src_bytes": src.stat().st_size,
        "method": label,
        "ref_files": [str(f) for f in files],
        "z": final,
        "z_bytes": final.stat().st_size,
        "quick": {lab: sz for sz, lab, *_ in ranked},
    }


# --------------------------------------------------------------------------
# carries
# --------------------------------------------------------------------------


def repo_travel_bytes() -> tuple[int, int]:
    def total(args):
        out = subprocess.run(
            ["git", "-C", str(REPO), *args, "-z"], capture_output=True, check=True
        ).stdout
        n = 0
        for f in out.split(b"\0"):
            if f:
                p = REPO / f.decode()
                if p.is_file():
                    n += p.stat().st_size
        return n

    return total(["ls-files"]), total(["ls-files", "--others", "--exclude-standard"])


@dataclasses.dataclass
class Stage:
    """The build of one stage: where its files go, how they are compressed,
    and what earlier releases left for the later ones' deltas."""

    work: Path
    dist: Path
    rels: list[str]
    level: int
    threads: int
    fa3: bool
    summary: dict
    staged_so: dict[str, dict[str, Path]] = dataclasses.field(default_factory=dict)

    @property
    def stage(self) -> Path:
        return self.work / "stage"

    def compress(self, src: Path, refs: list[tuple[str, list[Path]]]) -> dict:
        return compress(src, refs, self.work / "zcache", self.level, self.threads)

    def fallback_item(self, wheel: str) -> dict:
        """The zstandard wheel, carried raw in the first carry."""
        fb = wheel or next(
            iter(sorted(glob.glob(str(self.work / "deps/fallback/zstandard-*.whl")))),
            "",
        )
        if not fb:
            raise SystemExit(
                "build_stage: no zstandard wheel for the decompression fallback "
                "(see ci/gpu/README.md)"
            )
        fbp = Path(fb)
        z = {"z": fbp, "z_bytes": fbp.stat().st_size, "src_bytes": fbp.stat().st_size}
        z |= {"method": "raw", "quick": {}, "src_sha256": sha256(fbp), "ref_files": []}
        item = {"kind": "raw", "name": "zstandard-wheel", "dest": f"wheels/{fbp.name}"}
        return item | {"sha256": sha256(fbp), "z": z}

    def deps_item(self, deps: str) -> dict:
        """The dependency wheels, unpacked flat into one tar."""
        deps_whl = Path(deps) if deps else self.work / "deps" / "whl"
        dtar, dwheels = deps_tar(deps_whl, self.stage / "deps.tar")
        dz = self.compress(dtar, [])
        self.summary["deps"] = {
            "wheels": dwheels,
            "tar_bytes": dtar.stat().st_size,
            "z_bytes": dz["z_bytes"],
        }
        item = {"kind": "tar", "name": "deps", "dest": "deps", "z": dz}
        return item | {"tar_sha256": dz["src_sha256"], "keep_tar": False}

    def release_items(
        self, i: int, deps_item: dict, overlays: list[tuple[str, str]]
    ) -> list[dict]:
        """Release i's build items in carry order: its small items (the deps
        before the first release), its large compiled files by size, the
        marker that completes it, its variants."""
        rel = self.rels[i]
        whl = find_wheel(self.dist, rel)
        info = extract_release(whl, self.work, rel)
        so_files, notes = needed_so(rel, info, self.fa3)
        rs = {"wheel": whl.name, "wheel_sha256": info["wheel_sha256"], "notes": notes}
        rs["items"] = []
        self.summary["releases"][rel] = rs
        small = [self.py_item(i, info)]
        if i == 0:
            small.insert(0, deps_item)
        large = []
        self.staged_so[rel] = {}
        for rp in so_files:
            it = self.so_item(i, rp, info["so"] / rp)
            (large if it["z"]["z_bytes"] > 4 * MiB else small).append(it)
            self.staged_so[rel][rp] = info["so"] / rp
        large.sort(key=lambda x: x["z"]["z_bytes"])
        complete = {"kind": "complete", "name": f"{rel}:complete", "release": rel}
        complete["requires"] = [f"rel/{rel}/{rp}" for rp in so_files]
        complete["wheel_sha256"] = info["wheel_sha256"]
        variants = []
        for var, src in overlays:
            ovl, variant = self.overlay_items(rel, info, var, src)
            small.append(ovl)
            variants.append(variant)
            rs.setdefault("overlays", {})[var] = {"files": variant["files"]}
            rs["overlays"][var] |= variant["meta"]
        items = small + large + [complete] + variants
        for it in items:
            if "z" in it:
                z = it["z"]
                rs["items"].append(
                    {
                        "name": it["name"],
                        "method": z["method"],
                        "raw_bytes": z["src_bytes"],
                        "z_bytes": z["z_bytes"],
                        "quick_L3": z["quick"],
                    }
                )
        return items

    def py_item(self, i: int, info: dict) -> dict:
        """The release's Python tar, a delta against the previous release's."""
        rel, prev = self.rels[i], self.rels[i - 1] if i else None
        tar = py_tar(info["tree"], self.stage / f"py-{rel}.tar")
        refs = [(f"py-{prev}", [self.stage / f"py-{prev}.tar"])] if prev else []
        z = self.compress(tar, refs)
        item = {"kind": "tar", "name": f"py-{rel}", "dest": f"rel/{rel}", "z": z}
        item |= {"tar_sha256": z["src_sha256"], "keep_tar": i + 1 < len(self.rels)}
        item["store"] = f"py-{rel}.tar"
        item["ref_store"] = [f"py-{prev}.tar"] if z["method"] != "full" else []
        return item

    def so_item(self, i: int, rp: str, src: Path) -> dict:
        """A compiled file: whole, or a delta against the same file of an
        earlier release (for _C_stable_libtorch also _C + _C_stable_libtorch)."""
        rel = self.rels[i]
        refs = []
        for prel in self.rels[:i]:
            earlier = self.staged_so[prel]
            if rp in earlier:
                refs.append((f"{prel}:{rp}", [earlier[rp]]))
            if (
                rp.endswith("_C_stable_libtorch.abi3.so")
                and "vllm/_C.abi3.so" in earlier
            ):
                both = [earlier["vllm/_C.abi3.so"], earlier[rp]]
                refs.append((f"{prel}:_C+_C_stable_libtorch", both))
        z = self.compress(src, refs)
        ref_paths = []
        for f in z["ref_files"]:
            fp = Path(f)
            prel = fp.relative_to(self.work / "so").parts[0]
            ref_paths.append(
                f"rel/{prel}/" + str(fp.relative_to(self.work / "so" / prel))
            )
        item = {
            "kind": "file",
            "name": f"{rel}:{rp}",
            "dest": f"rel/{rel}/{rp}",
            "z": z,
        }
        return item | {"sha256": z["src_sha256"], "ref": ref_paths}

    def overlay_items(
        self, rel: str, info: dict, var: str, src: str
    ) -> tuple[dict, dict]:
        """An overlay's tar, and the variant build that applies it."""
        otar, files, meta = overlay_files(rel, info, src, self.work, var)
        oz = self.compress(otar, [])
        tar = {"kind": "tar", "name": f"overlay-{rel}-{var}"}
        tar |= {
            "dest": f"overlays/{rel}+{var}",
            "z": oz,
            "tar_sha256": oz["src_sha256"],
        }
        tar["keep_tar"] = False
        variant = {"kind": "variant", "name": f"{rel}+{var}", "release": rel}
        variant |= {"variant": var, "files": files, "meta": meta}
        return tar, variant


def parse_overlays(specs: list[str]) -> dict[str, list[tuple[str, str]]]:
    """--overlay REL:VARIANT=SOURCE (a glob: its first match) by release."""
    overlays: dict[str, list[tuple[str, str]]] = {}
    for o in specs:
        k, src = o.split("=", 1)
        rel, var = k.split(":")
        srcs = glob.glob(src) or [src]
        overlays.setdefault(rel, []).append((var, srcs[0]))
    return overlays


def cut(items: list[dict], budget: int) -> list[dict]:
    """The items' compressed streams cut into carries of at most `budget`
    bytes, in order; each item learns its parts, each carry its builds."""
    carries: list[dict] = []
    cur: dict = {"parts": [], "builds": [], "bytes": 0}

    def flush() -> None:
        nonlocal cur
        if cur["parts"] or cur["builds"]:
            carries.append(cur)
        cur = {"parts": [], "builds": [], "bytes": 0}

    for it in items:
        if "z" not in it:
            cur["builds"].append(it)
            continue
        zf: Path = it["z"]["z"]
        size = zf.stat().st_size
        # an item under 8 MiB that does not fit starts the next carry whole
        if size < 8 * MiB and cur["bytes"] + size > budget:
            flush()
        off = 0
        names = []
        k = 0
        while off < size:
            room = budget - cur["bytes"]
            if room < 1 * MiB:
                flush()
                room = budget
            n = min(room, size - off)
            pname = f"{it['name'].replace(':', '_').replace('/', '_')}.zst.{k}"
            cur["parts"].append(
                {"file": pname, "src": str(zf), "offset": off, "bytes": n}
            )
            cur["bytes"] += n
            names.append(pname)
            off += n
            k += 1
        it["parts"] = names
        cur["builds"].append(it)
    flush()
    return carries


def write_carry(cdir: Path, c: dict, call: str, requires: list[str]) -> int:
    """One carry folder: its parts and manifest.json; its size in bytes."""
    cdir.mkdir()
    parts = []
    for p in c["parts"]:
        with open(p["src"], "rb") as f:
            f.seek(p["offset"])
            data = f.read(p["bytes"])
        (cdir / p["file"]).write_bytes(data)
        parts.append(
            {"file": p["file"], "bytes": len(data), "sha256": sha256_bytes(data)}
        )
    builds = []
    for b in c["builds"]:
        d = {k: v for k, v in b.items() if k != "z"}
        if "z" in b:
            d["z_bytes"] = b["z"]["z_bytes"]
            d["method"] = b["z"]["method"]
        builds.append(d)
    man = {"call": call, "requires": requires, "parts": parts, "builds": builds}
    (cdir / "manifest.json").write_text(json.dumps(man, indent=1))
    return sum(f.stat().st_size for f in cdir.iterdir())


def write_carries(
    carries: list[dict], out: Path, prefix: str, repo_bytes: int
) -> tuple[list[tuple], bool]:
    """Every carry folder under `out` (emptied first); per carry its name,
    bytes, bytes with the repository, builds; and whether all fit."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rows = []
    ok = True
    for ci, c in enumerate(carries, 1):
        call = f"{prefix}{ci}"
        requires = [f"{prefix}{j}" for j in range(1, ci)]
        cbytes = write_carry(out / call, c, call, requires)
        travel = cbytes + repo_bytes
        rows.append((call, cbytes, travel, [b["name"] for b in c["builds"]]))
        if cbytes >= 60 * MiB + MiB // 2 or travel >= LIMIT:
            ok = False
    return rows, ok


def print_sizes(rows: list[tuple], summary: dict, tracked: int, untracked: int) -> None:
    log(
        f"\nrepo files that travel with every call: tracked {tracked / MiB:.2f} MiB "
        f"+ untracked {untracked / MiB:.2f} MiB"
    )
    log(f"{'carry':6} {'MiB':>7} {'with repo':>10}  completes")
    for r in rows:
        log(f"{r[0]:6} {r[1] / MiB:7.2f} {r[2] / MiB:10.2f}  {', '.join(r[3])}")
    for rel, rs in summary["releases"].items():
        log(f"\n{rel} ({rs['wheel']}): {rs['notes']}")
        for it in rs["items"]:
            log(
                f"  {it['name']:60s} {it['raw_bytes'] / MiB:8.1f} -> "
                f"{it['z_bytes'] / MiB:7.2f} MiB  ({it['method']})"
            )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--releases", default="v0.20.2,v0.22.0,v0.26.0")
    ap.add_argument("--dist", default=str(DEFAULT_DIST))
    ap.add_argument("--work", default="/work/stage")
    ap.add_argument(
        "--overlay", action="append", default=[], help="REL:VARIANT=WHEEL|DIR"
    )
    ap.add_argument(
        "--deps", default="", help="dependency wheels dir (default WORK/deps/whl)"
    )
    ap.add_argument("--budget", type=float, default=60.0, help="MiB per carry folder")
    ap.add_argument("--level", type=int, default=19)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fa3", action="store_true")
    ap.add_argument(
        "--zstd-fallback",
        default="",
        help="zstandard cp312 wheel carried raw in c1 "
        "(default WORK/deps/fallback/zstandard-*.whl): the device decompresses with it "
        "when it has no zstd command",
    )
    ap.add_argument("--out", default=str(REPO / ".dev" / "eng"))
    ap.add_argument(
        "--prefix", default="c", help="carry and call names: PREFIX1 .. PREFIXn"
    )
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    built = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    st = Stage(
        work=Path(a.work),
        dist=Path(a.dist),
        rels=[r for r in a.releases.split(",") if r],
        level=a.level,
        threads=a.threads,
        fa3=a.fa3,
        summary={"releases": {}, "built": built},
    )
    st.stage.mkdir(parents=True, exist_ok=True)
    items = [st.fallback_item(a.zstd_fallback)]
    deps_item = st.deps_item(a.deps)
    overlays = parse_overlays(a.overlay)
    for i, rel in enumerate(st.rels):
        items += st.release_items(i, deps_item, overlays.get(rel, []))
    tracked, untracked = repo_travel_bytes()
    carries = cut(items, int(a.budget * MiB))
    rows, ok = write_carries(carries, Path(a.out), a.prefix, tracked + untracked)
    st.summary["carries"] = [
        {"call": r[0], "carry_bytes": r[1], "travel_bytes": r[2], "builds": r[3]}
        for r in rows
    ]
    st.summary["repo_travel_bytes"] = {"tracked": tracked, "untracked": untracked}
    stage_json = json.dumps(st.summary, indent=1, default=str)
    (Path(a.out) / "STAGE.json").write_text(stage_json)
    print_sizes(rows, st.summary, tracked, untracked)
    if not ok:
        log(
            "\nbuild_stage: FAILED size check: a carry is >= 60.5 MiB or carry + "
            "repo >= 64 MiB"
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
