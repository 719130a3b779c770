"""Stage what the GPU rig carries to the device (here, from the repository
root). One script for both kinds of input:

    python3 ci/gpu/stage.py trees [NAME ...] [--releases v0.32.0,...]
    python3 ci/gpu/stage.py releases v0.20.2,v0.26.0 \\
        [--overlay REL:VARIANT=SOURCE ...] [--prefix c] [--budget MIB]

trees: vLLM source trees for run.sh's kernel-level parts, as .gpu/NAME.tar.gz
(vllm/ only: no compiled files, no C++ sources), each with NAME.tests, the
targeted tests `run.sh tests` runs on it (every Tests: line of the tree's
patches; on a release without them, each patch's first line: its regression
tests), and .gpu/MANIFEST saying what each tree is made of. The trees:
tq-base (v0.20.2), tq-0001 (+ tq/0001: the tree below tq/0002 that its
bit-exact test compares with), tq-patched (+ the tq patches of ./series),
v0.21.0, tq33-base (v0.33.0), tq33-patched, dsv4-base (apply.py base --stack
dsv4, pinned files in $VLLM_PATCHES_FETCHED), dsv4-patched and, with
--releases, tq33-on-REL (REL + the tq-v0.33 patches that apply there). NAMEs
keep only those and the tq33-on-REL (the carry limit is 64 MiB with .whl). Sources come from the
tool's cache ($VLLM_PATCHES_CACHE, filled by apply.py); a tree whose source
is missing is left out with a note.

releases: release wheels ($VLLM_PATCHES_CACHE/dist) for run.sh's engine part.
Per release one xz tar of the wheel's Python files and the compiled files its
engine loads (_C where present, _C_stable_libtorch, FA2, cumem, spinloop; FA3
only where the release does not force FA2 for TurboQuant); per --overlay
(SOURCE: a patched wheel, `apply.py wheel`, or a folder holding vllm/...,
engine/overlays.sh) one of the files the variant replaces; and the import-time
dependencies the device lacks (--deps: the wheels of .whl, unpacked). All cut
in order into carries .dev/eng/PREFIX1, PREFIX2, ... of at most --budget MiB
(by default what the device tool's 64 MiB leave beside the repository's
files), each with manifest.json for engine/setup.py. Exit 3 when a carry with
the repository's files reaches 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VLLM_PATCHES_CACHE", Path.home() / ".cache/vllm-patches"))
GIT = CACHE / "vllm.git"
MiB = 1 << 20
TREE_EXCLUDES = ("__pycache__", "vllm/vllm-rs", "*.h", "*.hpp", "*.cuh", "*.cu",
                 "*.cpp", "*.inl", "*.js")  # fmt: skip
SO_FILES = ("vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
            "vllm/cumem_allocator.abi3.so", "vllm/spinloop.abi3.so")  # fmt: skip
FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"


def sh(*cmd, cwd=None) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, text=True, stdout=subprocess.PIPE).stdout


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------
# trees
# --------------------------------------------------------------------------


def patches(stack: str) -> list[str]:
    """The stack's patches in ./series order."""
    lines = (REPO / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.startswith(f"{stack}/")]


def tests_of(patch: str, first_only: bool) -> list[str]:
    lines = re.findall(r"^Tests: (.+)$", (REPO / "patches" / patch).read_text(), re.M)
    return [t for ln in lines[: 1 if first_only else None] for t in ln.split()]


class Trees:
    """Builds the source trees into .gpu/ (a scratch folder for the exports)."""

    def __init__(self, only: list[str]) -> None:
        self.out, self.only = REPO / ".gpu", set(only)
        self.work = Path(tempfile.mkdtemp(prefix="stage-"))
        self.out.mkdir(exist_ok=True)
        for f in self.out.glob("*.tar.*"):
            f.unlink()
        for f in self.out.glob("*.tests"):
            f.unlink()
        self.manifest = []

    def note(self, line: str) -> None:
        print(line, flush=True)
        self.manifest.append(line)

    def export(self, name: str, ref: str, git: Path = GIT) -> Path | None:
        """vllm/ of ``ref`` in the scratch folder NAME (None: not in ``git``)."""
        ok = subprocess.run(["git", "--git-dir", str(git), "rev-parse", "-q",
                             "--verify", f"{ref}^{{commit}}"], capture_output=True)  # fmt: skip
        if ok.returncode:
            self.note(f"{name}: left out ({ref} is not in {git})")
            return None
        dest = self.work / name
        dest.mkdir()
        arc = subprocess.Popen(["git", "--git-dir", str(git), "archive", ref, "vllm"],
                               stdout=subprocess.PIPE)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arc.stdout, check=True)
        arc.wait()
        return dest

    def apply(self, dest: Path, stack: str, must: bool = True) -> list[str]:
        """``stack``'s patches applied in order (git apply); those applied."""
        done = []
        for p in patches(stack):
            r = subprocess.run(["git", "apply", "-p1", str(REPO / "patches" / p)],
                               cwd=dest, capture_output=True)  # fmt: skip
            if r.returncode and must:
                raise SystemExit(f"stage.py: {p} does not apply: {r.stderr.decode()}")
            if r.returncode:
                self.manifest.append(f"  - {p} (does not apply)")
            else:
                digest = sha256((REPO / "patches" / p).read_bytes())[:16]
                self.manifest.append(f"  + {p} sha256={digest}")
                done.append(p)
        return done

    def pack(self, name: str, dest: Path, note: str, tests: list[str]) -> None:
        """.gpu/NAME.tar.gz of vllm/ and NAME.tests."""
        tar = self.out / f"{name}.tar.gz"
        sh("tar", "-C", str(dest), "--sort=name", "--owner=0", "--group=0",
           "--numeric-owner", "--mtime=@0", *(f"--exclude={x}" for x in TREE_EXCLUDES),
           "-czf", str(tar), "vllm")  # fmt: skip
        (self.out / f"{name}.tests").write_text("".join(f"{t}\n" for t in dict.fromkeys(tests)))
        self.note(f"{tar.name} {tar.stat().st_size >> 10} KiB: {note}")

    def release(self, name: str, ref: str, stack: str | None, **kw) -> None:
        """A release alone (its regression tests: each patch's first Tests:
        line) or with ``stack`` applied (every Tests: line of those applied)."""
        if self.only and name not in self.only:
            return
        dest = self.export(name, ref, kw.get("git", GIT))
        if dest is None:
            return
        applied = self.apply(dest, stack, kw.get("must", True)) if stack else []
        base_of = kw.get("tests_of")
        tests = [t for p in applied for t in tests_of(p, False)]
        if base_of:
            tests = [t for p in patches(base_of) for t in tests_of(p, True)]
        self.pack(name, dest, kw.get("note", ref), tests)

    def tq0001(self) -> None:
        if self.only and "tq-0001" not in self.only:
            return
        dest = self.export("tq-0001", "v0.20.2")
        if dest:
            first = patches("tq")[0]
            sh("git", "apply", "-p1", str(REPO / "patches" / first), cwd=dest)
            self.pack("tq-0001", dest, f"v0.20.2 + {first}", [])

    def dsv4(self) -> None:
        """The dsv4 base as apply.py assembles it from the pinned files."""
        if self.only and not self.only & {"dsv4-base", "dsv4-patched"}:
            return
        fetched = os.environ.get("VLLM_PATCHES_FETCHED", REPO.parent / "shared/fixtures/dsv4")
        env = dict(os.environ, VLLM_PATCHES_FETCHED=str(fetched))
        r = subprocess.run([sys.executable, str(REPO / "apply.py"), "base", "--stack",
                            "dsv4", "--offline"], capture_output=True, text=True, env=env)  # fmt: skip
        if r.returncode:
            self.note(f"dsv4-*: left out (no dsv4 base: {r.stderr.strip()[-200:]})")
            return
        rev, commit, repo = r.stdout.split()[:3]  # "REV COMMIT repo=PATH ..."
        git = Path(repo.removeprefix("repo="))
        note = f"{rev} {commit} (apply.py base --stack dsv4)"
        self.release("dsv4-base", commit, None, git=git, note=note, tests_of="dsv4")
        self.release("dsv4-patched", commit, "dsv4", git=git, note=note + " + dsv4")

    def build(self, releases: list[str]) -> None:
        self.release("tq-base", "v0.20.2", None, tests_of="tq")
        self.tq0001()
        self.release("tq-patched", "v0.20.2", "tq", note="v0.20.2 + the tq patches")
        self.release("v0.21.0", "v0.21.0", None)
        self.release("tq33-base", "v0.33.0", None, tests_of="tq-v0.33")
        self.release("tq33-patched", "v0.33.0", "tq-v0.33", note="v0.33.0 + tq-v0.33")
        self.dsv4()
        for rel in releases:
            note = f"{rel} + the tq-v0.33 patches that apply there"
            self.release(f"tq33-on-{rel}", rel, "tq-v0.33", must=False, note=note)
        (self.out / "MANIFEST").write_text("\n".join(self.manifest) + "\n")
        shutil.rmtree(self.work)


# --------------------------------------------------------------------------
# releases (the engine)
# --------------------------------------------------------------------------


def wheel_of(rel: str) -> Path:
    found = sorted((CACHE / "dist").glob(f"vllm-{rel.lstrip('v')}-*.whl"))
    if not found:
        raise SystemExit(f"stage.py: no wheel for {rel} in {CACHE / 'dist'} (apply.py fills it)")
    return found[0]


SKIP = re.compile(r"\.(so|h|hpp|cuh|cu|cpp|inl)$|^vllm/vllm-rs|/__pycache__/|/static/")


def engine_files(z: zipfile.ZipFile, want: set[str]) -> dict[str, bytes]:
    """The wheel's vllm/ files the engine needs: no compiled files (but
    ``want``), C++ sources, Rust frontend or web assets."""
    names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith("/")]
    return {n: z.read(n) for n in names if n in want or not SKIP.search(n)}


def release_files(whl: Path, fa3: bool) -> dict[str, bytes]:
    """A release's files: SO_FILES, and FA3 where the release does not
    force FA2 for TurboQuant (or with --fa3)."""
    with zipfile.ZipFile(whl) as z:
        arg = z.read("vllm/engine/arg_utils.py").decode()
        forced = "TurboQuant is not yet compatible with FlashAttention >= 3" in arg
        return engine_files(z, set(SO_FILES) | ({FA3} if fa3 or not forced else set()))


def overlay_files(release: dict[str, bytes], source: Path) -> dict[str, bytes]:
    """The files of ``source`` (a wheel, or a folder holding vllm/) that
    differ from the release's."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            files = engine_files(z, {n for n in release if n.endswith(".so")})
    else:
        root = source if (source / "vllm").is_dir() else source.parent
        files = {str(f.relative_to(root)): f.read_bytes() for f in (root / "vllm").rglob("*")
                 if f.is_file() and "__pycache__" not in f.parts}  # fmt: skip
    changed = {n: d for n, d in files.items() if release.get(n) != d}
    if not changed or any(n.endswith(".so") for n in changed):
        raise SystemExit(f"stage.py: overlay {source}: nothing changed, or compiled files")
    return changed


def xz_tar(files: dict[str, bytes], out: Path) -> Path:
    """A deterministic tar of ``files``, xz -9 (cached by content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in sorted(files):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(files[name]), 0o755 if name.endswith(".so") else 0o644
            tf.addfile(ti, io.BytesIO(files[name]))
    raw = buf.getvalue()
    path = out.with_name(f"{out.name}-{sha256(raw)[:16]}.tar.xz")
    if not path.exists():
        print(f"[xz] {path.name} ({len(raw) / MiB:.0f} MiB)", flush=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            subprocess.run(["xz", "-9", "-T0", "-c"], input=raw, stdout=f, check=True)
        tmp.replace(path)
    return path


def deps_files(whl_dir: Path) -> dict[str, bytes]:
    """The wheels of ``whl_dir`` unpacked flat (one site folder)."""
    files: dict[str, bytes] = {}
    for w in sorted(whl_dir.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            files |= {n: z.read(n) for n in z.namelist() if not n.endswith(("/", ".a"))}
    if not files:
        raise SystemExit(f"stage.py: no wheels in {whl_dir} (ci/gpu/README.md: staging)")
    return files


def items(args) -> list[dict]:
    """Every compressed stream in carry order, with what it builds: the
    deps, then per release its tree and its variants."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = [{"name": "deps", "dest": "deps", "xz": xz_tar(deps_files(Path(args.deps)), work / "deps")}]
    overlays: dict[str, list[tuple[str, Path]]] = {}
    for spec in args.overlay:
        key, src = spec.split("=", 1)
        rel, var = key.split(":")
        overlays.setdefault(rel, []).append((var, Path(src)))
    for rel in args.releases.split(","):
        whl = wheel_of(rel)
        files = release_files(whl, args.fa3)
        xz = xz_tar(files, work / rel)
        out.append({"name": rel, "dest": f"rel/{rel}", "xz": xz, "wheel": whl.name})
        for var, src in overlays.get(rel, []):
            changed = overlay_files(files, src)
            xz = xz_tar(changed, work / f"{rel}+{var}")
            out.append({"name": f"{rel}+{var}", "dest": f"rel/{rel}+{var}",
                        "base": f"rel/{rel}", "xz": xz, "files": sorted(changed)})  # fmt: skip
    return out


def cut(streams: list[dict], budget: int) -> list[list[tuple]]:
    """The streams cut in order into carries of at most ``budget`` bytes:
    per carry its parts (stream, offset, size)."""
    carries: list[list[tuple]] = [[]]
    room = budget
    for s in streams:
        size, off = s["xz"].stat().st_size, 0
        while off < size:
            if room < MiB:
                carries.append([])
                room = budget
            n = min(room, size - off)
            carries[-1].append((s, off, n))
            off, room = off + n, room - n
    return carries


def write_carries(carries: list[list[tuple]], out: Path, prefix: str) -> list[int]:
    """Each carry folder: its parts and manifest.json (a stream is built in
    the carry holding its last part); the folders' sizes."""
    shutil.rmtree(out, ignore_errors=True)
    sizes = []
    for i, parts in enumerate(carries, 1):
        call = f"{prefix}{i}"
        (out / call).mkdir(parents=True)
        man = {"call": call, "requires": [f"{prefix}{j}" for j in range(1, i)],
               "parts": [], "builds": []}  # fmt: skip
        for s, off, n in parts:
            with open(s["xz"], "rb") as f:
                f.seek(off)
                data = f.read(n)
            part = f"{s['name']}.xz.{off // MiB}"
            (out / call / part).write_bytes(data)
            man["parts"].append({"file": part, "sha256": sha256(data)})
            s.setdefault("parts", []).append(part)
            if off + n == s["xz"].stat().st_size:
                build = {k: v for k, v in s.items() if k != "xz"}
                man["builds"].append(build | {"sha256": sha256(s["xz"].read_bytes())})
        (out / call / "manifest.json").write_text(json.dumps(man, indent=1))
        sizes.append(sum(f.stat().st_size for f in (out / call).iterdir()))
        print(f"{call}: {sizes[-1] / MiB:6.2f} MiB, builds "
              f"{', '.join(b['name'] for b in man['builds']) or '-'}")  # fmt: skip
    return sizes


def travelling_bytes() -> int:
    """The repository's files that travel with every call (tracked and
    untracked, not ignored)."""
    names = sh("git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard").splitlines()
    return sum((REPO / n).stat().st_size for n in names if (REPO / n).is_file())


def stage_releases(args) -> int:
    repo = travelling_bytes()
    budget = int(args.budget * MiB) if args.budget else 63 * MiB - repo
    print(f"the repository's files travel too: {repo / MiB:.2f} MiB; carries of "
          f"{budget / MiB:.2f} MiB")  # fmt: skip
    sizes = write_carries(cut(items(args), budget), Path(args.out), args.prefix)
    if max(sizes) + repo >= 64 * MiB:
        print("stage.py: a carry with the repository's files reaches 64 MiB: lower --budget")
        return 3
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trees", help="source trees into .gpu/")
    t.add_argument("names", nargs="*", help="only these trees")
    t.add_argument("--releases", default="", help="tq33-on-REL for these, comma list")
    r = sub.add_parser("releases", help="release wheels into .dev/eng/PREFIXn")
    r.add_argument("releases", help="comma list, oldest first")
    r.add_argument("--overlay", action="append", default=[], help="REL:VARIANT=WHEEL|DIR")
    r.add_argument("--deps", default=str(REPO / ".whl"), help="wheels of the import-time deps")
    r.add_argument("--budget", type=float, help="MiB a carry (63 - the repository's)")
    r.add_argument("--prefix", default="c", help="carry names: PREFIX1 ...")
    r.add_argument("--fa3", action="store_true", help="stage FA3 as well")
    r.add_argument("--work", default=str(CACHE / "stage"), help="the compressed streams")
    r.add_argument("--out", default=str(REPO / ".dev" / "eng"))
    args = ap.parse_args()
    if args.what == "trees":
        releases = [x for x in args.releases.split(",") if x]
        only = args.names + [f"tq33-on-{r}" for r in releases] if args.names else []
        Trees(only).build(releases)
        return 0
    return stage_releases(args)


if __name__ == "__main__":
    sys.exit(main())
