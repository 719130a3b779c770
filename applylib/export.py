"""apply.py export: one upstream PR branch per patch; registers the
delivery commands (wheel, export)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path, PurePosixPath

from .bases import (
    Base,
    BaseUnavailable,
    cache_dir,
    find_user_repo,
    locked,
    resolve_base,
    worktree,
)
from .core import (
    IDENTITY,
    REF_NS,
    SPDX,
    UserError,
    common,
    format_patch,
    git,
    git_common_dir,
    gout,
    rev_commit,
    say,
)
from .pinned import fetched_dir
from .runner import PatchResult, apply_stack
from .series import (
    DIFF_GIT,
    Patch,
    Series,
    Stack,
    check_safe_relpath,
    load_patch,
    parse_series,
    pick_patch,
)
from .testrun import run_tests, test_python
from .wheelbuild import cmd_wheel

VLLM_ISSUE = re.compile(r"^https://github\.com/vllm-project/vllm/issues/(\d+)/?$")


# Trailers about the series, not the change: PR commits leave them out (Bug
# and Related become the PR body's links).
PR_DROP_TRAILERS = {"bug", "related", "upstream-status", "upstream-target", "tests"}


# Subject component -> vLLM's test directory for it.
COMPONENT_TESTS = {
    "attention": "tests/v1/attention",
    "turboquant": "tests/v1/attention",
    "kernel": "tests/kernels",
    "quantization": "tests/quantization",
}


# The pieces of tests/patches/conftest.py an exported test module may need,
# written for vLLM's own test tree (vllm imported directly, no VLLM_TREE).
EXPORT_HARNESS = {
    "env": """\
if not _torch.cuda.is_available():
    # CPU-only host: run Triton kernels in Triton's interpreter.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
""",
    "VLLM_TREE": """\
# The directory holding the vllm package under test.
os.environ.setdefault(
    "VLLM_TREE",
    str(Path(importlib.util.find_spec("vllm").origin).resolve().parents[1]),
)
""",
    "gpu": """\
_needs_gpu = pytest.mark.skipif(
    not _torch.cuda.is_available(), reason="needs a CUDA GPU"
)
""",
    "vllm_tree": '''\
@pytest.fixture(scope="session")
def vllm_tree() -> Path:
    """The directory holding the vllm package under test."""
    import vllm

    return Path(vllm.__file__).resolve().parents[1]
''',
    "device": """\
@pytest.fixture
def device() -> "_torch.device":
    return _torch.device("cuda" if _torch.cuda.is_available() else "cpu")
""",
    "_accelerator_empty_cache_noop": """\
@pytest.fixture(autouse=True)
def _accelerator_empty_cache_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    # WorkspaceManager calls torch.accelerator.empty_cache(), which raises on
    # a CPU-only torch.
    if _torch.accelerator.current_accelerator() is None:
        monkeypatch.setattr(_torch.accelerator, "empty_cache", lambda: None)
""",
    "cpu_platform": '''\
@pytest.fixture
def cpu_platform(vllm_tree: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM's CpuPlatform as current_platform on a CPU-only host."""
    import vllm.platforms as platforms

    if _torch.cuda.is_available():
        return platforms.current_platform
    from vllm.platforms.cpu import CpuPlatform

    plat = CpuPlatform()
    monkeypatch.setattr(platforms, "_current_platform", plat)
    return plat
''',
}


def fixture_names(conftest: Path) -> set[str]:
    import ast

    if not conftest.is_file():
        return set()
    names = set()
    for node in ast.parse(conftest.read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(
            "fixture" in ast.unparse(d) for d in node.decorator_list
        ):
            names.add(node.name)
    return names


def adapt_test_module(src: Path, rel: str) -> tuple[str, list[str]]:
    """The series' test module, made to run in vLLM's own test tree.

    The series runs it against the tree named by VLLM_TREE with the fixtures
    of its conftest.py; in vLLM's tree vllm is imported directly, and the
    harness pieces the module uses are defined in it, after its imports.
    Returns the new text and what was adapted, in words.
    """
    import ast

    text = src.read_text()
    mod = ast.parse(text)
    used = {
        a.arg
        for n in ast.walk(mod)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs
    }
    bound = set()
    for n in mod.body:
        if isinstance(n, ast.Import):
            bound |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            bound |= {a.asname or a.name for a in n.names}
    uses_torch = any(
        (
            isinstance(n, ast.Import)
            and any(a.name.split(".")[0] == "torch" for a in n.names)
        )
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch")
        for n in ast.walk(mod)
    )
    done = []
    if re.search(r"\bpytest\.mark\.gpu\b", text):
        text = re.sub(r"\bpytest\.mark\.gpu\b", "_needs_gpu", text)
        done.append("pytest.mark.gpu became a skipif(no CUDA) mark")
        want = ["gpu"]
    else:
        want = []
    if uses_torch or want or used & {"device", "cpu_platform"}:
        want.insert(0, "env")
        done.append(
            'on a CPU-only host CUDA_VISIBLE_DEVICES="" and '
            "TRITON_INTERPRET=1 are set unless set"
        )
    if "VLLM_TREE" in text:
        want.append("VLLM_TREE")
        done.append(
            "VLLM_TREE defaults to the directory holding the imported vllm package"
        )
    if "cpu_platform" in used:
        used.add("vllm_tree")
    fixtures = [f for f in ("vllm_tree", "device", "cpu_platform") if f in used]
    if fixtures:
        done.append(
            f"fixture(s) {', '.join(fixtures)} defined in the module "
            "(from the series' conftest.py)"
        )
    want += fixtures
    if uses_torch:
        want.append("_accelerator_empty_cache_noop")
        done.append(
            "torch.accelerator.empty_cache() is a no-op where there is "
            "no accelerator (autouse fixture, as in the series)"
        )
    missing = sorted(
        fixture_names(src.parent / "conftest.py") & used - set(EXPORT_HARNESS)
    )
    if missing:
        say(
            f"apply.py export: warning: {rel} uses fixture(s) "
            f"{', '.join(missing)} of the series' conftest.py, not provided "
            "in vLLM's tree"
        )
        done.append(f"NOT provided: fixture(s) {', '.join(missing)}")
    # after the docstring, __future__ imports and the module's own imports
    at = 0
    for i, node in enumerate(mod.body):
        doc = (
            i == 0
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        )
        if not (doc or isinstance(node, (ast.Import, ast.ImportFrom))):
            break
        at = node.end_lineno
    lines = text.splitlines(keepends=True)
    import textwrap

    note = textwrap.fill(
        f"Adapted from the vllm-patches series ({rel}), which runs it against "
        "a source tree with the harness of its conftest.py: here vllm is "
        "imported directly"
        + (
            ", and the harness pieces used below are defined in this module."
            if want
            else "."
        ),
        78,
        initial_indent="# ",
        subsequent_indent="# ",
    )
    pre = ["\n" + note + "\n"]
    if want:
        needs = {
            "importlib": "VLLM_TREE" in want,
            "os": bool({"env", "VLLM_TREE"} & set(want)),
            "Path": bool({"VLLM_TREE", "vllm_tree", "cpu_platform"} & set(want)),
            "pytest": bool(set(want) - {"env", "VLLM_TREE"}),
        }
        imports = {
            "importlib": "import importlib.util\n",
            "os": "import os\n",
            "Path": "from pathlib import Path\n",
            "pytest": "import pytest\n",
        }
        add = [
            imports[k]
            for k, need in needs.items()
            if need
            and not (k in bound if k != "importlib" else "importlib.util" in bound)
        ]
        if set(want) - {"VLLM_TREE"} and "torch" not in bound:
            add.append("import torch as _torch\n")
        pre.insert(0, "".join(add))  # with the module's own imports
        for w in want:
            sep = (
                "\n\n"
                if w
                in (
                    "vllm_tree",
                    "device",
                    "cpu_platform",
                    "_accelerator_empty_cache_noop",
                )
                else "\n"
            )
            piece = EXPORT_HARNESS[w]
            if "torch" in bound:  # the module's own `import torch`
                piece = re.sub(r"\b_torch\b", "torch", piece)
            pre.append(sep + piece)
        pre.append("\n\n# " + "-" * 74 + "\n")
    new = "".join(lines[:at]) + "".join(pre) + "".join(lines[at:])
    if not new.startswith(SPDX[0]):
        new = "\n".join(SPDX) + "\n" + ("" if new.startswith("\n") else "\n") + new
        done.append("vLLM's SPDX header added")
    return new, done


def helper_paths(src: Path) -> list[Path]:
    """Sibling modules and packages of a test module that it names."""
    text = src.read_text()
    out = []
    for p in sorted(src.parent.iterdir()):
        stem = p.stem if p.suffix == ".py" else p.name
        if (
            p.name in ("conftest.py", "__init__.py", "__pycache__")
            or p.name.startswith(("test_", "."))
            or p == src
            or not (p.is_dir() or p.suffix == ".py")
        ):
            continue
        n = re.escape(stem)
        if re.search(rf"\bimport\s+{n}\b|\bfrom\s+{n}\b|['\"]{n}['\"]", text):
            out.append(p)
    return out


def vllm_test_dir(repo: Path, rev: str, patch: Patch) -> str:
    """Where vLLM keeps the tests of what a patch changes.

    By the subject's component ([Attention][TurboQuant] ...) where vLLM has
    a test directory for it; else by the code the patch changes most: vLLM
    mirrors its package in tests/ (vllm/model_executor/... is tested in
    tests/model_executor/), the deepest such directory the base has, else
    the first two levels (a release base made from a wheel has no tests/).
    """
    for comp in re.findall(r"\[([^\]]+)\]", patch.subject.split("] ")[0] + "]"):
        if comp.lower() in COMPONENT_TESTS:
            return COMPONENT_TESTS[comp.lower()]
    weight: dict[str, int] = {}
    for block in re.split(rb"(?m)^(?=diff --git )", patch.raw):
        m = DIFF_GIT.match(block)
        if not m or b"\ndeleted file mode " in block.split(b"\n@@", 1)[0]:
            continue
        path = m.group(2).decode()
        if path.startswith("vllm/") and path.endswith(".py"):
            weight[path] = sum(
                1
                for ln in block.split(b"\n")[1:]
                if ln[:1] in (b"+", b"-") and not ln.startswith((b"+++ ", b"--- "))
            )
    if not weight:
        return "tests"
    parts = PurePosixPath(max(weight, key=weight.__getitem__)).parts[1:-1]
    for k in range(len(parts), 0, -1):
        d = "tests/" + "/".join(parts[:k])
        if git("cat-file", "-e", f"{rev}:{d}", cwd=repo, check=False).returncode == 0:
            return d
    return "tests/" + "/".join(parts[:2]) if parts else "tests"


def git_identity(repo: Path) -> tuple[str, str] | None:
    name = git("config", "user.name", cwd=repo, check=False).stdout.decode()
    email = git("config", "user.email", cwd=repo, check=False).stdout.decode()
    if name.strip() and email.strip():
        return name.strip(), email.strip()
    return None


def split_trailers(msg: str) -> tuple[str, list[tuple[str, str]]]:
    """A commit message's text before its trailer block, and the trailers."""
    paras = msg.strip().split("\n\n")
    last = paras[-1].splitlines()
    if (
        len(paras) > 1
        and last
        and all(re.match(r"^[A-Za-z0-9][A-Za-z0-9-]*: ", ln) for ln in last)
    ):
        return "\n\n".join(paras[:-1]), [
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in last)
        ]
    return msg.strip(), []


def pr_message(
    patch: Patch,
    msg: str,
    tests: list[tuple[str, str, list[str]]],
    node_ids: list[str],
    result: str | None,
    signoff: tuple[str, str],
    needs: list[Patch],
    renames: dict[str, str],
) -> tuple[str, str, list[str]]:
    """The commit message and PR body in vLLM's PR template.

    The patch message's own sections (a "Purpose" / "## Purpose" paragraph
    and the like) are sorted into the template's: Purpose (with Fix and other
    sections as its subsections), Test Plan (the carried test's command
    first, then the patch's own plan with the series' paths replaced by the
    exported ones), Test Result (the patch's, and ours when run). "When to
    drop" is about the series only and is left out. Returns the message,
    the body and the titles of the sections left out.
    """
    text, trailers = split_trailers(msg)
    subject, _, body = text.partition("\n")
    purpose, plan_own, result_own, dropped = [], [], [], []
    for title, part in message_sections(body):
        key = (title or "purpose").lower()
        if key == "purpose":
            purpose.append(part)
        elif key.startswith("test plan") or key in ("testing", "tests"):
            plan_own.append(part)
        elif key.startswith("test result"):
            result_own.append(part)
        elif key == "when to drop":
            dropped.append(title)
        else:
            purpose.append(f"### {title}\n\n{part}")
    links = []
    for b in patch.values("Bug"):
        m = VLLM_ISSUE.match(b)
        links.append(f"FIX #{m.group(1)}" if m else f"Related: {b}")
    links += [f"Related: {r}" for r in patch.values("Related")]
    if needs:
        links += ["", "This change applies on top of (to be merged first):"]
        links += [f"- {p.subject}" for p in needs]
    plan = [
        "Regression tests added with this change (they fail before it "
        "and pass with it):",
        "",
        "```bash",
        "pytest -v " + " \\\n    ".join(map(shlex.quote, node_ids)),
        "```",
    ]
    for dst, src, done in tests:
        plan += [
            "",
            f"`{dst}` comes from the vllm-patches series (`{src}`), "
            "adapted to vLLM's test tree: "
            + ("; ".join(done) if done else "copied unchanged")
            + ".",
        ]
    for part in plan_own:
        for old in sorted(renames, key=len, reverse=True):
            part = part.replace(old, renames[old])
        plan += ["", re.sub(r"\bVLLM_TREE=\S+\s+", "", part)]
    if result is None:
        result = (
            ""
            if result_own
            else (
                "Not run by `apply.py export` (give --run-tests, or paste the Test "
                "Plan's output before and after this change)."
            )
        )
    kept = [(k, v) for k, v in trailers if k.lower() not in PR_DROP_TRAILERS]
    sob = f"{signoff[0]} <{signoff[1]}>"
    if ("Signed-off-by", sob) not in kept:
        kept.append(("Signed-off-by", sob))
    pr_body = re.sub(
        r"\n{3,}",
        "\n\n",
        "\n".join(
            [
                "## Purpose",
                "",
                "\n\n".join(purpose),
                "",
                *links,
                "",
                "## Test Plan",
                "",
                *plan,
                "",
                "## Test Result",
                "",
                "\n\n".join(result_own),
                "",
                result.strip(),
            ]
        ),
    )
    pr_body = pr_body.strip()
    message = (
        subject.strip()
        + "\n\n"
        + pr_body
        + "\n\n"
        + "\n".join(f"{k}: {v}" for k, v in kept)
        + "\n"
    )
    return message, pr_body + "\n", dropped


SECTION_TITLES = {
    "purpose",
    "fix",
    "why",
    "how",
    "test plan",
    "test result",
    "test results",
    "testing",
    "tests",
    "when to drop",
    "related pr",
    "future plan",
}


def message_sections(body: str) -> list[tuple[str | None, str]]:
    """(title, text) of a commit message body's sections, in order.

    A section starts at a Markdown heading (`## Fix`) or at a known title
    alone on its line between blank lines (`Test Plan`); text before any is
    titled None. Fenced code blocks are never split.
    """
    lines = body.strip("\n").splitlines()
    out: list[tuple[str | None, list[str]]] = [(None, [])]
    fence = False
    for i, ln in enumerate(lines):
        if ln.startswith("```"):
            fence = not fence
        title = None
        if not fence:
            m = re.match(r"^#{1,4} +(\S.*?)[ #]*$", ln)
            alone = (i == 0 or not lines[i - 1].strip()) and (
                i + 1 == len(lines) or not lines[i + 1].strip()
            )
            if m:
                title = m.group(1)
            elif alone and ln.strip().rstrip(":").lower() in SECTION_TITLES:
                title = ln.strip().rstrip(":")
        if title:
            out.append((title, []))
        else:
            out[-1][1].append(ln)
    return [(t, "\n".join(ls).strip()) for t, ls in out if t or "\n".join(ls).strip()]


def export_ref(repo: Path, name: str, force: bool) -> str:
    if git("check-ref-format", "--branch", name, cwd=repo, check=False).returncode != 0:
        raise UserError(f"'{name}' is not a valid branch name")
    ref = f"refs/heads/{name}"
    for ln in gout("worktree", "list", "--porcelain", cwd=repo).splitlines():
        if ln == f"branch {ref}":
            raise UserError(
                f"branch '{name}' is checked out in a worktree of "
                f"{repo}; pick another --branch"
            )
    if not ref.startswith(REF_NS + "/") and rev_commit(repo, ref) and not force:
        raise UserError(
            f"branch '{name}' exists and is not the tool's (not "
            f"under {REF_NS[len('refs/heads/') :]}/): pick another "
            "--branch, or --force to overwrite it"
        )
    return ref


def cmd_export(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    stack, entry = pick_patch(series, args.patch)
    patches = [load_patch(series, e) for e in stack.patches]
    idx = stack.patches.index(entry)
    patch = patches[idx]
    if not patch.regression:
        raise UserError(
            f"patches/{entry}: no 'Tests:' trailer, so no "
            "regression test to carry in the PR"
        )
    test_files = list(dict.fromkeys(t.split("::", 1)[0] for t in patch.regression))
    for f in test_files:
        check_safe_relpath(f, f"patches/{entry}: test")
        if not (series.root / f).is_file():
            raise UserError(f"patches/{entry}: test file {f} does not exist")
    user_repo = find_user_repo(args.repo)
    fetched = fetched_dir(args)
    base = None
    pin = stack.file_pins.get(entry)
    if pin and not args.base:  # the patch's own base ('#@ pin'), when at hand
        try:
            base = resolve_base(
                dataclasses.replace(stack, pins=pin, file_pins={}),
                None,
                user_repo,
                args.offline,
            )
        except BaseUnavailable as e:
            say(
                f"apply.py export: {entry}'s own pin {pin['commit'][:12]} is "
                f"not at hand ({e.reason}): using the stack's base"
            )
    try:
        base = base or resolve_base(stack, args.base, user_repo, args.offline, fetched)
    except BaseUnavailable as e:
        raise UserError(f"base unavailable: {e.reason} (to get it: {e.hint})") from None
    stem = Path(entry).stem
    branch = args.branch or f"{REF_NS[len('refs/heads/') :]}/pr/{stem}"
    ref = export_ref(base.repo, branch, args.force)
    ident = git_identity(base.repo)
    signoff = ident or IDENTITY
    python = test_python(args.python)
    rid = hashlib.sha1(str(git_common_dir(base.repo)).encode()).hexdigest()[:10]
    with locked(rid):
        key = f"{stack.name}-export"
        wt = worktree(base.repo, key, base.commit)
        results = {p.file: PatchResult(p.file) for p in patches[: idx + 1]}
        needs: list[Patch] = []
        if apply_stack(wt, [patch], results):
            wt = worktree(base.repo, key, base.commit)
            results = {p.file: PatchResult(p.file) for p in patches[: idx + 1]}
            conflicts = apply_stack(wt, patches[: idx + 1], results)
            if patch in conflicts:
                print(
                    f"{entry}: does not apply on {base.rev}, alone or after "
                    "the patches before it (conflicts in "
                    f"{', '.join(results[entry].conflict_files) or '?'})"
                )
                return 1
            needs = [
                p for p in patches[:idx] if results[p.file].apply in ("clean", "3way")
            ]
        am_commit = gout("rev-parse", "HEAD", cwd=wt)
        parent = gout("rev-parse", "HEAD~1", cwd=wt)
        dest = args.test_dir or vllm_test_dir(wt, am_commit, patch)
        check_safe_relpath(dest, "--test-dir")
        placed: list[tuple[str, str, list[str]]] = []
        renamed: dict[str, str] = {}
        renames: dict[str, str] = {}  # series paths -> vLLM tree paths
        for f in test_files:
            src = series.root / f
            name = src.name
            if (
                git(
                    "cat-file", "-e", f"{am_commit}:{dest}/{name}", cwd=wt, check=False
                ).returncode
                == 0
            ):
                name = f"{src.stem}_regression.py"
            text, done = adapt_test_module(src, f)
            target = wt / dest / name
            if target.exists():
                raise UserError(
                    f"{dest}/{name} already exists in the tree: give --test-dir"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            added = [f"{dest}/{name}"]
            for h in helper_paths(src):
                files = (
                    [h]
                    if h.is_file()
                    else sorted(
                        x
                        for x in h.rglob("*")
                        if x.is_file()
                        and "__pycache__" not in x.parts
                        and x.suffix != ".pyc"
                    )
                )
                for x in files:
                    rel = x.relative_to(src.parent).as_posix()
                    (wt / dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(x, wt / dest / rel)
                    added.append(f"{dest}/{rel}")
                done.append(f"helper {h.name} copied alongside")
                renames[(PurePosixPath(f).parent / h.name).as_posix()] = (
                    f"{dest}/{h.name}"
                )
            git("add", "-f", "--", *added, cwd=wt)
            placed.append((f"{dest}/{name}", f, done))
            renamed[f] = renames[f] = f"{dest}/{name}"
        node_ids = [
            renamed[t.split("::", 1)[0]] + t[len(t.split("::", 1)[0]) :]
            for t in patch.regression
        ]
        result = None
        if args.run_tests:
            result = export_test_result(
                series, base, patch, parent, am_commit, stack, python
            )
        msg = gout("log", "-1", "--format=%B", am_commit, cwd=wt)
        message, body, dropped = pr_message(
            patch, msg, placed, node_ids, result, signoff, needs, renames
        )
        tree = gout("write-tree", cwd=wt)
        who = gout(
            "log", "-1", "--format=%an%x00%ae%x00%ad", "--date=raw", am_commit, cwd=wt
        ).split("\0")
        env = {
            "GIT_AUTHOR_NAME": who[0],
            "GIT_AUTHOR_EMAIL": who[1],
            "GIT_AUTHOR_DATE": who[2],
            "GIT_COMMITTER_NAME": signoff[0],
            "GIT_COMMITTER_EMAIL": signoff[1],
            "GIT_COMMITTER_DATE": who[2],
        }
        commit = gout(
            "commit-tree", tree, "-p", parent, cwd=wt, env=env, input=message.encode()
        )
        git("update-ref", "-m", f"apply.py export {entry}", ref, commit, cwd=base.repo)
    out_dir = cache_dir() / "export"
    out_dir.mkdir(parents=True, exist_ok=True)
    body_file = out_dir / f"{stem}.md"
    body_file.write_text(body)
    patch_file = out_dir / f"{stem}.patch"  # the commit, exported as the series'
    patch_file.write_bytes(format_patch(base.repo, commit))
    exported = Exported(
        entry, ref, branch, commit, parent, base, needs, placed, body_file, patch_file
    )
    report_export(exported, patch, dropped, signoff, bool(ident), stem)
    if args.json:
        Path(args.json).write_text(json.dumps(exported.as_json(patch), indent=2) + "\n")
    return 0


@dataclasses.dataclass
class Exported:
    """What export made: the branch (ref, commit) and the files beside it."""

    entry: str
    ref: str
    branch: str
    commit: str
    parent: str
    base: Base
    needs: list[Patch]
    placed: list[tuple[str, str, list[str]]]
    body_file: Path
    patch_file: Path

    def as_json(self, patch: Patch) -> dict:
        return {
            "patch": self.entry,
            "ref": self.ref,
            "repo": str(self.base.repo),
            "commit": self.commit,
            "parent": self.parent,
            "base": self.base.rev,
            "base_commit": self.base.commit,
            "needs": [p.file for p in self.needs],
            "tests": [{"file": d, "from": s, "adapted": a} for d, s, a in self.placed],
            "body_file": str(self.body_file),
            "patch_file": str(self.patch_file),
            "target": upstream_target(patch),
        }


def upstream_target(patch: Patch) -> str:
    """Where the change goes: the patch's 'Upstream-Target:', else vLLM's
    main."""
    return (patch.values("Upstream-Target") or ["vllm-project/vllm main"])[0]


def report_export(
    ex: Exported,
    patch: Patch,
    dropped: list[str],
    signoff: tuple[str, str],
    has_identity: bool,
    stem: str,
) -> None:
    base = ex.base
    print(f"{ex.ref} in {base.repo}")
    print(f"  {ex.commit[:12]} {patch.subject}")
    on = (
        f"{base.rev} ({base.commit[:12]})"
        if not ex.needs
        else f"{ex.needs[-1].file} ({ex.parent[:12]}) on {base.rev}"
    )
    print(f"  parent: {on}")
    if ex.needs:
        print(
            f"  note: {ex.entry} does not apply on {base.rev} alone; the branch "
            f"is based on the patches before it: "
            f"{', '.join(p.file for p in ex.needs)} (open those PRs first, or "
            "say in this one that it depends on them)"
        )
    for dst, src, done in ex.placed:
        print(f"  test: {dst} (from {src}; " + ("; ".join(done) or "unchanged") + ")")
    if dropped:
        print(
            f"  left out of the PR message (about the series only): "
            f"{', '.join(dropped)}"
        )
    print(
        f"  signed off by: {signoff[0]} <{signoff[1]}>"
        + ("" if has_identity else " (no git identity configured: the project's)")
    )
    print(f"  PR description: {ex.body_file}")
    print(f"  as a patch file: {ex.patch_file}")
    if patch.values("Upstream-Target"):
        print(f"target: {upstream_target(patch)}")
        print(
            "  not a PR against vllm-project/vllm main: the code it changes is "
            "not there. Offer the patch file and description where the target "
            "says."
        )
        return
    if base.source in ("cache", "pypi") and re.search(
        r"^Release: ",
        gout("log", "-1", "--format=%B", base.commit, cwd=base.repo),
        re.M,
    ):
        print(
            f"  note: {base.repo} is the tool's cache: its {base.rev} is the "
            "release's Python sources (from the wheel), not vLLM's history. "
            "To open the PR, export in a vLLM clone "
            f"(apply.py export {stem} --repo ~/src/vllm), or carry the "
            f"commit to a branch at {base.rev} there: git -C ~/src/vllm am -k "
            f"{ex.patch_file}"
        )
    remote_branch = (
        ex.branch.split("/", 1)[1]
        if ex.branch.startswith(REF_NS[len("refs/heads/") :] + "/")
        else ex.branch
    )
    print(
        "to open the PR (vLLM takes PRs against main: rebase the branch there "
        "first if its base is a release):"
    )
    print(
        f"  git -C {shlex.quote(str(base.repo))} push YOUR_FORK_REMOTE "
        f"{ex.ref}:refs/heads/{remote_branch}"
    )
    print(
        f"  gh pr create --repo vllm-project/vllm --base main --head "
        f"YOUR_GITHUB_USER:{remote_branch} --title {shlex.quote(patch.subject)} "
        f"--body-file {shlex.quote(str(ex.body_file))}"
    )


def export_test_result(
    series: Series,
    base: Base,
    patch: Patch,
    parent: str,
    patched: str,
    stack: Stack,
    python: str,
) -> str:
    """The regression tests run (series harness) before and with the change."""
    before_wt = worktree(base.repo, f"{stack.name}-export-base", parent)
    ids = patch.regression
    before, _ = run_tests(series.root, before_wt, ids, python, "export, before")
    after_wt = worktree(base.repo, f"{stack.name}-export-after", patched)
    after, _ = run_tests(series.root, after_wt, ids, python, "export, with it")
    rows = [f"| `{t}` | {before[t].verdict} | {after[t].verdict} |" for t in ids]
    return "\n".join(
        [
            "Run by `apply.py export --run-tests` with the series' harness "
            f"(`{ids[0].split('::')[0]}` against the tree before and with this "
            "change):",
            "",
            "| test | before | with this change |",
            "|---|---|---|",
            *rows,
        ]
    )


def add_deliver_commands(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    w = sub.add_parser(
        "wheel",
        formatter_class=fmt,
        help="patched vLLM wheel from the official one (no CUDA build)",
        description="Apply a stack and write the official vLLM wheel of the "
        "base's release with exactly the files the patched tree changes "
        "replaced (new ones added, deleted ones removed), a PEP 440 local "
        "version naming the series (<release>+<stack>.<hash>) in its metadata "
        "and vllm/_version.py, and RECORD regenerated by 'wheel pack'. Refuses "
        "a series that changes compiled sources (csrc/, CMake, *.cu, *.cpp, "
        "setup.py) and a wheel of another version. Needs the 'wheel' package "
        "(>=0.48) in the --python.",
        epilog="example:\n  python apply.py wheel --stack tq --out dist\n"
        "  python apply.py wheel --base v0.20.2 --from-wheel "
        "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl",
    )
    common(w, "base", helps={"base": "base release vX.Y.Z (default: the stack's pin)"})
    w.add_argument(
        "--from-wheel",
        metavar="FILE",
        help="the official wheel (default: from the tool's cache, "
        "else downloaded with pip)",
    )
    w.add_argument("--out", default="dist", help="output directory (default: ./dist)")
    w.add_argument(
        "--force",
        action="store_true",
        help="ship base + patch even where the wheel's copy of a changed file "
        "differs from the base tree's",
    )
    w.set_defaults(func=cmd_wheel)
    common(w, "stack", "repo", "python", "offline", "json", "fetched")

    e = sub.add_parser(
        "export",
        formatter_class=fmt,
        help="one upstream PR branch for one patch",
        description="Create a branch (default refs/heads/patched/pr/<patch>) in "
        "the vLLM repository (--repo, else the tool's cache) with the patch as "
        "one commit on the stack's base (or on the patches before it, when it "
        "only applies there), its message in vLLM's PR template (Purpose, Test "
        "Plan, Test Result; FIX #N from Bug: issues), signed off, and its "
        "regression test adapted into vLLM's tests/. Prints the push and "
        "PR-creation commands. The checkout, its index and other branches are "
        "never touched.",
        epilog="example:\n  python apply.py export tq/0001 --repo ~/src/vllm\n"
        "  git -C ~/src/vllm log -1 -p patched/pr/0001-...",
    )
    e.add_argument("patch", help="patch file name or unique prefix")
    e.add_argument("--branch", help="branch name (default: patched/pr/<patch>)")
    common(e, "base")
    e.add_argument(
        "--test-dir",
        help="where the test goes in vLLM's tree "
        "(default: by the subject's [Component], else tests/ "
        "mirroring the changed module)",
    )
    e.add_argument(
        "--run-tests",
        action="store_true",
        help="run the regression tests before and with the change "
        "and put the results in Test Result",
    )
    e.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing branch outside the tool's namespace",
    )
    e.set_defaults(func=cmd_export)
    common(e, "repo", "python", "offline", "json", "fetched")
