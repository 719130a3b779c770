"""status --installed: the vLLM installed in a Python environment, checked
against the series.

What is installed there is read, never written: the environment's own
interpreter runs only with bytecode writing off (``-B``,
``PYTHONDONTWRITEBYTECODE=1``), from a scratch directory, to report what
it has (the vllm distribution, its RECORD, the package's folder) and to
import the patched modules; the regression tests import the installed
package the same way.

Per patch of the stack that matches the installed release, whether it is
in effect: for every file the patch changes, the installed file's sha256
is compared with the file of the patched tree (the whole stack applied
on that release) and of the release itself. Where the installed vLLM is
a wheel made by ``apply.py wheel`` from this very series (its
``.dist-info/vllm_patches.json`` names the same series digest), that
manifest holds both hashes of every file and no base is needed (what a
serving image checks at build time, offline and without git); otherwise
the release's base is obtained like any base and the stack applied to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path, PurePosixPath

from .bases import BaseUnavailable, find_user_repo, locked, with_pinned_base, worktree
from .core import UserError, git_common_dir, gout
from .probe import VERSION, describe, pick_python, run_inspected
from .runner import PatchResult, apply_stack, preimages, table
from .series import (
    Patch,
    Series,
    Stack,
    check_agreement,
    load_patch,
    parse_series,
    short_name,
)
from .testrun import Outcome, aggregate, run_tests, test_python
from .wheelbuild import WHEEL_MANIFEST as MANIFEST
from .wheelbuild import blob_hashes, record_hash

# Run by the inspected Python: import each module, report where from. Where
# Triton has no active driver (no GPU, e.g. an image build), vLLM puts a
# placeholder in its place, and a module that uses triton.language at import
# fails there patched or not (UltraQuant's): "no_triton" says so.
IMPORTS = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
        out[name] = {"file": getattr(mod, "__file__", None) or ""}
    except ModuleNotFoundError as e:
        out[name] = {"missing": e.name or "", "error": repr(e)[:300]}
    except BaseException as e:
        tu = sys.modules.get("vllm.triton_utils")
        out[name] = {"error": repr(e)[:300], "no_triton": isinstance(
            e, AttributeError) and "'triton" in str(e) and tu is not None
            and getattr(tu, "HAS_TRITON", True) is False}
print("\n" + json.dumps(out))
"""


def pick_stacks(series: Series, want: str | None, vllm: dict, manifest) -> list[Stack]:
    """--stack NAME[,NAME] or 'all'; else the stack the patched wheel names;
    else the stacks pinned to the installed release."""
    if want == "all":
        return list(series.stacks)
    if want:
        return [series.stack(n) for n in want.split(",")]
    names = {s.name for s in series.stacks}
    if manifest and manifest.get("stack") in names:
        return [series.stack(manifest["stack"])]
    rel = vllm["release"]
    return [
        s for s in series.stacks if rel and s.pins.get("tag", "").lstrip("v") == rel
    ]


def no_stack_message(series: Series, vllm: dict) -> str:
    rel = vllm["release"]
    pinned = [
        (s.pins["tag"].lstrip("v"), s.name)
        for s in series.stacks
        if VERSION.match(s.pins.get("tag", "").lstrip("v"))
    ]

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v))

    below = [p for p in pinned if rel and key(p[0]) < key(rel)]
    what = f"release {rel}" if rel else f"version {vllm['version']} (not a release)"
    msg = f"no stack of the series is pinned to {what}: nothing to check"
    if below:
        v, name = max(below, key=lambda p: key(p[0]))
        msg += (
            f" (the newest stack below it is '{name}', pinned to v{v}: "
            f"--stack {name} checks it against this release)"
        )
    return msg


# --------------------------------------------------------------------------
# What the patched and the unpatched content of each file is
# --------------------------------------------------------------------------


def shipped(path: str) -> bool:
    """A file an installed vLLM holds (the wheel ships vllm/ only)."""
    return PurePosixPath(path).parts[0] == "vllm"


def reference_from_manifest(
    series: Series, stack: Stack, patches: list[Patch], manifest: dict | None
) -> dict | None:
    """The hashes the patched wheel recorded, when it was made by apply.py
    wheel from this very series (same digest); else None."""
    if not manifest or manifest.get("stack") != stack.name:
        return None
    if manifest.get("series_sha256") != series.digest(stack):
        return None
    hashes = manifest.get("file_hashes")
    listed = {p.get("file"): p.get("files") for p in manifest.get("patches", [])}
    if hashes is None or any(listed.get(p.file) is None for p in patches):
        return None  # made by an apply.py that did not record them
    return {
        "kind": "wheel manifest",
        "files": hashes,
        "patch_files": {
            p.file: [f for f in listed[p.file] if f in hashes] for p in patches
        },
        "not_applied": {},
    }


def reference_from_trees(
    stack: Stack,
    patches: list[Patch],
    rev: str | None,
    user_repo: Path | None,
    offline: bool,
) -> dict:
    """The stack applied on the base of the installed release (the stack's
    pin when the version is not a release), in the tool's own worktree."""
    try:
        base, pinned = with_pinned_base(stack, rev, user_repo, offline)
    except BaseUnavailable as e:
        raise UserError(
            f"base {rev or 'of stack ' + stack.name} unavailable: {e.reason} "
            f"(to get it: {e.hint})"
        ) from None
    results = {p.file: PatchResult(p.file) for p in patches}
    key = hashlib.sha1(str(git_common_dir(base.repo)).encode()).hexdigest()[:10]
    with locked(key):
        preimages(stack, patches, base, pinned)
        wt = worktree(base.repo, f"{stack.name}-installed", base.commit)
        failed = apply_stack(wt, patches, results)
        head = gout("rev-parse", "HEAD", cwd=wt)
        paths = sorted({f for p in patches for f in p.files if shipped(f)})
        release = blob_hashes(wt, base.commit, paths)
        patched = blob_hashes(wt, head, paths)
    return {
        "kind": "patched tree",
        "base": {"rev": base.rev, "commit": base.commit, "source": base.source},
        "head": head,
        "files": {
            f: {"release": release.get(f), "patched": patched.get(f)} for f in paths
        },
        "patch_files": {p.file: [f for f in p.files if shipped(f)] for p in patches},
        "not_applied": {p.file: results[p.file].apply for p in failed},
    }


# --------------------------------------------------------------------------
# Judging the installed files
# --------------------------------------------------------------------------


def installed_hash(root: Path, path: str) -> str | None:
    f = root / path
    return record_hash(f.read_bytes()) if f.is_file() else None


def file_state(have: str | None, ref: dict) -> str:
    """patched (the patched tree's content, or absent where the stack
    deletes it), release (the release's), or other."""
    if have == ref["patched"]:
        return "patched"
    if have == ref["release"]:
        return "release"
    return "missing" if have is None else "other"


def patch_states(root: Path, patches: list[Patch], ref: dict) -> dict[str, dict]:
    """Per patch: in-effect, absent, modified (files named), does-not-apply
    (on that release) or not-installed (changes no installed file)."""
    states = {
        f: file_state(installed_hash(root, f), h) for f, h in ref["files"].items()
    }
    out = {}
    for p in patches:
        files = ref["patch_files"][p.file]
        mine = {f: states[f] for f in files}
        if p.file in ref["not_applied"]:
            state = "does-not-apply"
        elif not files:
            state = "not-installed"
        elif all(s == "patched" for s in mine.values()):
            state = "in-effect"
        elif all(s == "release" for s in mine.values()):
            state = "absent"
        else:
            state = "modified"
        out[p.file] = {
            "installed": state,
            "files": mine,
            "modified_files": [f for f, s in mine.items() if s != "patched"]
            if state == "modified"
            else [],
        }
    return out


def as_built(root: Path, manifest: dict, record: dict[str, str]) -> dict:
    """Each file the patched wheel changed: still as the wheel's RECORD has
    it (deleted ones still gone)?"""
    same, differ = [], []
    for path, status in manifest.get("files", {}).items():
        have = installed_hash(root, path)
        ok = (
            have is None
            if status == "D"
            else have is not None and have == record.get(path)
        )
        (same if ok else differ).append(path)
    return {"files": len(same) + len(differ), "as_built": len(same), "differ": differ}


# --------------------------------------------------------------------------
# Running the regression tests and the imports
# --------------------------------------------------------------------------


def regression_verdicts(
    series: Series,
    patches: list[Patch],
    vllm: dict,
    python: str,
    in_place: bool,
) -> tuple[dict[str, Outcome], str]:
    """Every patch's regression tests, run once against the installed vLLM.

    In place (the test Python is the inspected one): the package's root
    folder is the tree. Otherwise only the installed ``vllm`` package is
    taken from that environment (a folder holding a link to it leads the
    path; VLLM_TREE names the real root, so the harness's "imported from
    the tree" check holds); everything else is the test Python's own."""
    ids = list(dict.fromkeys(t for p in patches for t in p.regression))
    root = Path(vllm["root"])
    extra = {"PYTHONDONTWRITEBYTECODE": "1", "VLLM_TREE": str(root)}
    with tempfile.TemporaryDirectory(prefix="vllm-patches-installed-") as tmp:
        tree = root
        if not in_place:
            tree = Path(tmp) / "tree"
            tree.mkdir()
            (tree / "vllm").symlink_to(Path(vllm["package"]), target_is_directory=True)
        outs, log = run_tests(
            series.root, tree, ids, python, "installed vllm", extra_env=extra
        )
    return {p.file: aggregate([outs[t] for t in p.regression]) for p in patches}, log


def module_name(path: str) -> str | None:
    if not path.endswith(".py") or "/" not in path:
        return None
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def check_imports(python: str, root: Path, paths: list[str]) -> dict:
    """Import each installed module among `paths` with the environment's
    own Python; each must load from its installed file. A module needing a
    package this environment lacks, or Triton with a GPU driver where vLLM
    has none, is noted, not counted as a failure."""
    names = {}
    for p in paths:
        name = module_name(p)
        if name and (root / p).is_file():
            names[name] = (root / p).resolve()
    if not names:
        return {"ok": [], "failed": {}, "notes": []}
    proc = run_inspected(python, IMPORTS, *names)
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": [], "failed": {n: last for n in names}, "notes": []}
    ok, failed, notes = [], {}, []
    for name, want in names.items():
        r = got.get(name, {})
        if r.get("missing") and r["missing"].split(".")[0] != "vllm":
            notes.append(f"{name}: not importable here (needs {r['missing']})")
        elif r.get("no_triton"):
            notes.append(
                f"{name}: not importable here (it uses Triton at import, and "
                f"Triton has no GPU driver here: {r['error']})"
            )
        elif "error" in r:
            failed[name] = f"import failed: {r['error']}"
        elif Path(r["file"]).resolve() != want:
            failed[name] = f"imported from {r['file']}, not {want}"
        else:
            ok.append(name)
    return {"ok": ok, "failed": failed, "notes": notes}


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------

BUG = {
    "fail": "present",
    "pass": "absent",
    "error": "cannot tell",
    "skip": "cannot tell",
}


def pick_test_python(arg: str | None, python: str, info: dict) -> tuple[str, bool]:
    """The Python that runs the regression tests, and whether it is the
    inspected one (the tests then run in place)."""
    chosen = arg or (python if info.get("has_pytest") else test_python(None))
    return chosen, os.path.abspath(chosen) == os.path.abspath(python)


def wheel_info(
    series: Series, vllm: dict, manifest: dict | None, info: dict
) -> dict | None:
    """What the patched wheel says it is made of, and whether its files are
    still as built (RECORD)."""
    if manifest is None:
        return None
    out = {
        k: manifest.get(k)
        for k in ("version", "release", "stack", "series_sha256", "base")
    }
    names = {s.name: s for s in series.stacks}
    st = names.get(manifest.get("stack", ""))
    out["series_matches"] = bool(st) and series.digest(st) == manifest.get(
        "series_sha256"
    )
    out.update(as_built(Path(vllm["root"]), manifest, info.get("record") or {}))
    return out


def check_stack(
    series: Series, stack: Stack, vllm: dict, manifest: dict | None, args, user_repo
) -> dict:
    patches = [load_patch(series, p) for p in stack.patches]
    ref = reference_from_manifest(series, stack, patches, manifest)
    if ref is None:
        rev = f"v{vllm['release']}" if vllm["release"] else None
        ref = reference_from_trees(stack, patches, rev, user_repo, args.offline)
    states = patch_states(Path(vllm["root"]), patches, ref)
    pin = stack.pins.get("tag") or stack.pins.get("branch") or stack.pins.get("commit")
    return {
        "name": stack.name,
        "pin": pin,
        "reference": {k: ref[k] for k in ("kind", "base", "head") if k in ref},
        "patches": [{"file": p.file, **states[p.file]} for p in patches],
        "loaded": patches,
    }


def conclude(stacks: list[dict], verdicts: dict[str, Outcome] | None) -> None:
    """Each patch's bug verdict, whether it is needed, and whether it is ok:
    in effect with its bug not present, or not needed (it does not apply
    on the installed release and its regression tests pass there)."""
    for st in stacks:
        for p in st["patches"]:
            o = verdicts.get(p["file"]) if verdicts is not None else None
            if o is None:
                p["bug"], p["regression"] = "not run", None
            else:
                p["bug"] = BUG[o.verdict]
                p["regression"] = {"verdict": o.verdict, "reason": o.reason}
            p["needed"] = not (
                p["installed"] == "does-not-apply" and p["bug"] == "absent"
            )
            p["ok"] = not p["needed"] or (
                p["installed"] in ("in-effect", "not-installed")
                and p["bug"] != "present"
            )


def cmd_installed(args: argparse.Namespace) -> int:
    """status --installed: find the environment and its vLLM, pick the
    stacks, judge the files, run the regression tests and the imports,
    print, and exit 0 only when every needed patch is in effect."""
    series = parse_series(Path(args.series))
    check_agreement(series)
    python, info = pick_python(getattr(args, "python", None))
    vllm = describe(python, info)
    manifest = json.loads(info["manifest"]) if info.get("manifest") else None
    report: dict = {"python": python, "vllm": vllm}
    report["wheel"] = wheel_info(series, vllm, manifest, info)
    stacks = pick_stacks(series, getattr(args, "stack", None), vllm, manifest)
    report["stacks"] = []
    if not stacks:
        report["message"] = no_stack_message(series, vllm)
    user_repo = find_user_repo(getattr(args, "repo", None))
    for st in stacks:
        report["stacks"].append(
            check_stack(series, st, vllm, manifest, args, user_repo)
        )
    patches = [p for st in report["stacks"] for p in st.pop("loaded")]
    verdicts = None
    test_py, in_place = pick_test_python(args.test_python, python, info)
    if patches and not args.no_tests:
        verdicts, _ = regression_verdicts(series, patches, vllm, test_py, in_place)
    report["tests"] = {
        "python": test_py,
        "in_place": in_place,
        "ran": verdicts is not None,
    }
    conclude(report["stacks"], verdicts)
    changed = sorted(
        {f for st in report["stacks"] for p in st["patches"] for f in p["files"]}
    )
    report["imports"] = check_imports(python, Path(vllm["root"]), changed)
    bad = [p for st in report["stacks"] for p in st["patches"] if not p["ok"]]
    report["exit_code"] = 1 if bad or report["imports"]["failed"] else 0
    print_installed(report)
    if getattr(args, "json", None):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return report["exit_code"]


def print_header(report: dict) -> None:
    v, w = report["vllm"], report["wheel"]
    by = f" (installed by {v['installer']})" if v.get("installer") else ""
    print(f"vllm {v['version']} in {report['python']}{by}")
    print(f"  package: {v['package']}")
    up = f", upstream commit {v['upstream_commit']}" if v.get("upstream_commit") else ""
    print(f"  release {v['release'] or '(none: not a release version)'}{up}")
    if v.get("note"):
        print(f"  note: {v['note']}")
    if w is None:
        print(f"  not made by apply.py wheel (no .dist-info/{MANIFEST})")
        return
    same = "the same as this series'" if w["series_matches"] else "NOT this series'"
    built = (
        f"all {w['files']} files as built"
        if not w["differ"]
        else f"{w['as_built']} of {w['files']} files as built; differ from the "
        f"wheel's RECORD: {', '.join(w['differ'])}"
    )
    print(
        f"  installed from vllm-{w['version']} (apply.py wheel): stack {w['stack']}, "
        f"series digest {(w['series_sha256'] or '?')[:16]} ({same}), {built}"
    )


def print_stack_result(st: dict) -> None:
    ref = st["reference"]
    if ref["kind"] == "wheel manifest":
        against = "the hashes the patched wheel recorded (same series)"
    else:
        b = ref["base"]
        against = (
            f"the stack applied on {b['rev']} ({b['commit'][:12]}, from {b['source']})"
        )
    print(f"== stack {st['name']} (pinned to {st['pin']}): judged against {against}")
    tested = any(p["regression"] for p in st["patches"])
    rows = [("patch", "installed", "bug", "regression tests")[: 4 if tested else 2]]
    for p in st["patches"]:
        verdict = p["regression"]["verdict"] if p["regression"] else "not run"
        row = (short_name(p["file"]), p["installed"], p["bug"], verdict)
        rows.append(row[: 4 if tested else 2])
    for line in table(rows):
        print("  " + line)
    for p in st["patches"]:
        for f in p["modified_files"]:
            what = {
                "release": "the release's content",
                "missing": "missing",
                "other": "neither the patched nor the release's content",
            }[p["files"][f]]
            print(f"  {short_name(p['file'])}: modified: {f} ({what})")
        r = p["regression"]
        if r and r["verdict"] != "pass" and r["reason"]:
            print(
                f"  {short_name(p['file'])}: regression tests: {r['verdict']}: {r['reason']}"
            )
        if p["installed"] == "in-effect" and p["bug"] == "present":
            print(
                f"  {short_name(p['file'])}: in effect, but the bug is present anyway"
            )
    for p in st["patches"]:
        print(f"    {short_name(p['file'])}: {p['file']}")


def print_installed(report: dict) -> None:
    print_header(report)
    if report.get("message"):
        print(report["message"])
    for st in report["stacks"]:
        print_stack_result(st)
    imp = report["imports"]
    for n in imp["notes"]:
        print(f"imports: note: {n}")
    for name, why in imp["failed"].items():
        print(f"imports: FAILED: {name}: {why}")
    if imp["ok"] or imp["failed"]:
        print(
            f"imports: {len(imp['ok'])} of {len(imp['ok']) + len(imp['failed'])} "
            "changed module(s) load from the installed files"
        )
    t = report["tests"]
    if t["ran"]:
        how = (
            "in place"
            if t["in_place"]
            else "only its vllm package, with the test Python's own packages"
        )
        print(
            f"regression tests: run by {t['python']} against the installed vllm ({how})"
        )
    patches = [p for st in report["stacks"] for p in st["patches"]]
    if patches:
        done = [p for p in patches if p["installed"] == "in-effect"]
        bad = [
            f"{short_name(p['file'])} ({p['installed']}"
            + (f", bug {p['bug']})" if p["regression"] else ")")
            for p in patches
            if not p["ok"]
        ]
        print(
            f"result: {len(done)} of {len(patches)} patches in effect"
            + (f"; not as needed: {', '.join(bad)}" if bad else "")
        )
