"""apply.py export's texts: the PR message in vLLM's template, and the
series' regression test module adapted to vLLM's test tree."""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import textwrap
from pathlib import Path

from .core import IDENTITY, SPDX, say
from .series import Patch

# What names this project rather than vLLM in a PR's text: its paths and
# its series' words (a PR stands alone, with its evidence as numbers).
SERIES_WORDS = re.compile(
    r"(?<![\w/.-])(?:ci|docs|patches|tests/patches)/"
    r"|\b(?:previous|next|earlier|later)(?: \w+)? patch(?:es)?\b"
    r"|(?<![\w.-])0\d{3}(?:'s)?\b"
    r"|\b(?:the|this) series\b|\bvllm-patches\b|\bapply\.py\b"
    r"|\bthis applies on\b|\bthis patch can be dropped\b"
    r"|\b(?:tq|tq-v0\.33|dsv4)/\d{4}\b",
    re.IGNORECASE,
)


def series_words(text: str) -> list[str]:
    """The lines of a PR text that name this project's paths or series."""
    return [ln.strip() for ln in text.splitlines() if SERIES_WORDS.search(ln)]


VLLM_ISSUE = re.compile(r"^https://github\.com/vllm-project/vllm/issues/(\d+)/?$")


# Trailers about the series, not the change: PR commits leave them out (Bug
# and Related become the PR body's links).
PR_DROP_TRAILERS = {"bug", "related", "upstream-status", "upstream-target", "tests"}


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
    text = src.read_text()
    mod = ast.parse(text)
    names = ModuleNames.of(mod)
    # a module whose helpers drive vLLM's kernels needs what torch users do
    names.uses_torch = names.uses_torch or bool(helper_paths(src))
    text, want, done = harness_wanted(text, names)
    done += missing_fixtures(src, rel, names.used)
    lines = text.splitlines(keepends=True)
    at = imports_end(mod)
    pre = ["\n" + adaptation_note(rel, bool(want)) + "\n"]
    if want:
        pre.insert(0, harness_imports(want, names.bound))  # with the module's own
        pre += harness_pieces(want, names.bound)
    new = "".join(lines[:at]) + "".join(pre) + "".join(lines[at:])
    if not new.startswith(SPDX[0]):
        new = "\n".join(SPDX) + "\n" + ("" if new.startswith("\n") else "\n") + new
        done.append("vLLM's SPDX header added")
    return new, done


@dataclasses.dataclass
class ModuleNames:
    """What a test module's harness needs are read from."""

    used: set[str]  # the arguments of its functions (fixtures among them)
    bound: set[str]  # the names its top-level imports bind
    uses_torch: bool  # it imports torch anywhere

    @classmethod
    def of(cls, mod: ast.Module) -> ModuleNames:
        """The names of a parsed module."""
        used = {
            a.arg
            for n in ast.walk(mod)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs
        }
        bound = set()
        for n in mod.body:
            if isinstance(n, ast.Import) or (
                isinstance(n, ast.ImportFrom) and n.module
            ):
                bound |= {a.asname or a.name for a in n.names}
        uses_torch = any(
            (
                isinstance(n, ast.Import)
                and any(a.name.split(".")[0] == "torch" for a in n.names)
            )
            or (
                isinstance(n, ast.ImportFrom)
                and (n.module or "").split(".")[0] == "torch"
            )
            for n in ast.walk(mod)
        )
        return cls(used, bound, uses_torch)


def harness_wanted(text: str, names: ModuleNames) -> tuple[str, list[str], list[str]]:
    """The module's text with pytest.mark.gpu rewritten, the EXPORT_HARNESS
    pieces it needs (in order), and what that adapts, in words."""
    used = names.used
    done = []
    if re.search(r"\bpytest\.mark\.gpu\b", text):
        text = re.sub(r"\bpytest\.mark\.gpu\b", "_needs_gpu", text)
        done.append("pytest.mark.gpu became a skipif(no CUDA) mark")
        want = ["gpu"]
    else:
        want = []
    if names.uses_torch or want or used & {"device", "cpu_platform"}:
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
    if names.uses_torch:
        want.append("_accelerator_empty_cache_noop")
        done.append(
            "torch.accelerator.empty_cache() is a no-op where there is "
            "no accelerator (autouse fixture, as in the series)"
        )
    return text, want, done


def missing_fixtures(src: Path, rel: str, used: set[str]) -> list[str]:
    """The series' conftest.py fixtures the module uses that vLLM's tree does
    not provide: warned about, and said in words."""
    missing = sorted(
        fixture_names(src.parent / "conftest.py") & used - set(EXPORT_HARNESS)
    )
    if not missing:
        return []
    say(
        f"apply.py export: warning: {rel} uses fixture(s) "
        f"{', '.join(missing)} of the series' conftest.py, not provided "
        "in vLLM's tree"
    )
    return [f"NOT provided: fixture(s) {', '.join(missing)}"]


def imports_end(mod: ast.Module) -> int:
    """The line after the docstring, __future__ imports and the module's own
    imports: where the harness goes."""
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
    return at


def adaptation_note(rel: str, with_harness: bool) -> str:
    """The comment that says where the module comes from and what changed."""
    return textwrap.fill(
        f"Adapted from the vllm-patches series ({rel}), which runs it against "
        "a source tree with the harness of its conftest.py: here vllm is "
        "imported directly"
        + (
            ", and the harness pieces used below are defined in this module."
            if with_harness
            else "."
        ),
        78,
        initial_indent="# ",
        subsequent_indent="# ",
    )


def harness_imports(want: list[str], bound: set[str]) -> str:
    """The imports the harness pieces need that the module lacks."""
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
        if need and not (k in bound if k != "importlib" else "importlib.util" in bound)
    ]
    if set(want) - {"VLLM_TREE"} and "torch" not in bound:
        add.append("import torch as _torch\n")
    return "".join(add)


def harness_pieces(want: list[str], bound: set[str]) -> list[str]:
    """The EXPORT_HARNESS pieces, spaced, then a rule before the module's
    own code."""
    pre = []
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
    return pre


def helper_paths(src: Path) -> list[Path]:
    """Sibling modules and packages of a test module that it names, and
    those they name in turn (a helper's helpers travel with it)."""
    found: list[Path] = []
    todo = [src]
    while todo:
        for p in named_siblings(todo.pop()):
            if p != src and p not in found:
                found.append(p)
                if p.suffix == ".py":
                    todo.append(p)
    return sorted(found)


def named_siblings(src: Path) -> list[Path]:
    """The sibling modules and packages `src` names (imports or strings)."""
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
    node_ids: list[str],
    result: str | None,
    signoff: tuple[str, str],
    needs: list[Patch],
    renames: dict[str, str],
    fix_pr: str | None = None,
    kept_test: bool = False,
) -> tuple[str, str, list[str]]:
    """The commit message and PR body in vLLM's PR template.

    The patch message's own sections (a "Purpose" / "## Purpose" paragraph
    and the like) are sorted into the template's: Purpose (with Fix and other
    sections as its subsections), Test Plan (the carried test's command
    first, then the patch's own plan with the series' paths replaced by the
    exported ones), Test Result (the patch's, and ours when run). "When to
    drop" is about the series only and is left out. With `fix_pr` (an
    upstream PR that carries the fix already) the PR holds the tests alone,
    for that PR. With `kept_test` (the PR carries the patch's own test for
    vLLM) the patch's plan, about the series' tests, is left out too.
    Returns the message, the body and the titles of the sections left out.
    """
    text, trailers = split_trailers(msg)
    subject, _, body = text.partition("\n")
    own = TemplateSections.of(body)
    if kept_test:  # the patch's plan and result are about the series' tests
        own.dropped += [t for t, part in (("Test plan", own.plan),
                                          ("Test result", own.result)) if part]  # fmt: skip
        own.plan, own.result = [], []
    plan = pr_test_plan(node_ids, own.plan, renames, fix_pr)
    links = pr_links(patch, needs)
    if fix_pr:
        subject, links = tests_only_text(subject, own, links, fix_pr)
    if result is None:
        result = (
            ""
            if own.result
            else (
                "Not run yet: paste the Test Plan's output before and after this "
                "change (export --run-tests fills it in)."
            )
        )
    pr_body = template_body(own, links, plan, result)
    message = (
        subject.strip()
        + "\n\n"
        + pr_body
        + "\n\n"
        + "\n".join(f"{k}: {v}" for k, v in pr_trailers(trailers, signoff))
        + "\n"
    )
    return message, pr_body + "\n", own.dropped


@dataclasses.dataclass
class TemplateSections:
    """A patch message's sections, sorted into vLLM's PR template's."""

    purpose: list[str]  # Purpose, then other sections as ### subsections
    plan: list[str]  # the patch's own Test Plan
    result: list[str]  # the patch's own Test Result
    dropped: list[str]  # the titles left out (about the series only)

    @classmethod
    def of(cls, body: str) -> TemplateSections:
        """The sections of a commit message body, sorted."""
        own = cls([], [], [], [])
        for title, part in message_sections(body):
            key = (title or "purpose").lower()
            part, when = without_when_to_drop(part)
            if when and "When to drop" not in own.dropped:
                own.dropped.append("When to drop")
            if not part:
                continue
            if key == "purpose":
                own.purpose.append(part)
            elif key.startswith("test plan") or key in ("testing", "tests"):
                own.plan.append(part)
            elif key.startswith("test result"):
                own.result.append(part)
            elif key == "when to drop":
                own.dropped.append(title)
            else:
                own.purpose.append(f"### {title}\n\n{part}")
        return own


WHEN_TO_DROP = re.compile(
    r"This\s+patch\s+can\s+be\s+dropped\b.*?(?=\n\n|\Z)", re.DOTALL
)


def without_when_to_drop(text: str) -> tuple[str, bool]:
    """`text` without its "This patch can be dropped once ..." sentences
    (about the series only: each runs to the end of its paragraph), and
    whether it had one."""
    out = WHEN_TO_DROP.sub("", text)
    out = re.sub(r"[ \t]*\n(?=\n|\Z)", "\n", out)  # the cut's trailing space
    return re.sub(r"\n{3,}", "\n\n", out).strip(), out != text


def pr_links(patch: Patch, needs: list[Patch]) -> list[str]:
    """The Purpose's links: FIX #N for vLLM issues, Related: for the rest,
    and the patches this one applies on top of."""
    links = []
    for b in patch.values("Bug"):
        m = VLLM_ISSUE.match(b)
        links.append(f"FIX #{m.group(1)}" if m else f"Related: {b}")
    links += [f"Related: {r}" for r in patch.values("Related")]
    if needs:
        links += ["", "This change applies on top of (to be merged first):"]
        links += [f"- {p.subject}" for p in needs]
    return links


def tests_only_text(
    subject: str, own: TemplateSections, links: list[str], fix_pr: str
) -> tuple[str, list[str]]:
    """A tests-only PR's subject and links, its Purpose led by what it is:
    the regression tests of the fix `fix_pr` carries."""
    ref = "#" + m.group(1) if (m := re.search(r"/pull/(\d+)", fix_pr)) else fix_pr
    tags, rest = re.fullmatch(r"((?:\[[^\]]*\])*)\s*(.*)", subject).groups()
    rest = rest[:1].lower() + rest[1:]
    own.purpose.insert(
        0,
        f"Regression tests for the fix of {ref}, without the fix: they fail "
        f"without {ref}'s change and pass with it. What they check:",
    )
    own.purpose[1:] = [
        re.sub(r"^### Fix\b", "### The fix they were run with", x)
        for x in own.purpose[1:]
    ]
    links = [x.replace("FIX #", "Related: #", 1) for x in links]
    return f"{tags} Regression tests for {ref}: {rest}".strip(), [
        f"Tests the fix of: {fix_pr}",
        *links,
    ]


def pr_test_plan(
    node_ids: list[str],
    plan_own: list[str],
    renames: dict[str, str],
    fix_pr: str | None = None,
) -> list[str]:
    """The Test Plan's lines: the carried tests' command, then the patch's
    own plan with the exported paths (how each test was adapted is the
    export's output, not the PR's)."""
    plan = [
        (
            f"Regression tests (they fail without the fix of {fix_pr} and pass "
            "with it):"
            if fix_pr
            else "Regression tests added with this change (they fail before it "
            "and pass with it):"
        ),
        "",
        "```bash",
        "pytest -v " + " \\\n    ".join(map(shlex.quote, node_ids)),
        "```",
    ]
    for part in plan_own:
        for old in sorted(renames, key=len, reverse=True):
            part = part.replace(old, renames[old])
        plan += ["", re.sub(r"\bVLLM_TREE=\S+\s+", "", part)]
    return plan


def pr_trailers(
    trailers: list[tuple[str, str]], signoff: tuple[str, str]
) -> list[tuple[str, str]]:
    """The trailers the PR commit keeps, signed off. The series' own
    identity signs nothing off; as the co-author of a backport it stands
    for the one who submits the adaptation."""
    project = f"{IDENTITY[0]} <{IDENTITY[1]}>"
    sob = f"{signoff[0]} <{signoff[1]}>"
    kept = []
    for k, v in trailers:
        if k.lower() == "co-authored-by" and v == project:
            v = sob
        drop = k.lower() in PR_DROP_TRAILERS or (
            k.lower() == "signed-off-by" and v == project
        )
        if not drop and (k, v) not in kept:
            kept.append((k, v))
    if ("Signed-off-by", sob) not in kept:
        kept.append(("Signed-off-by", sob))
    return kept


def template_body(
    own: TemplateSections, links: list[str], plan: list[str], result: str
) -> str:
    """The PR body: Purpose, Test Plan, Test Result."""
    pr_body = re.sub(
        r"\n{3,}",
        "\n\n",
        "\n".join(
            [
                "## Purpose",
                "",
                "\n\n".join(own.purpose),
                "",
                *links,
                "",
                "## Test Plan",
                "",
                *plan,
                "",
                "## Test Result",
                "",
                "\n\n".join(own.result),
                "",
                result.strip(),
            ]
        ),
    )
    return pr_body.strip()


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
