"""The docs check: what README.md, CHANGELOG.md and docs/*.md show stays true.

Fast and offline (no vLLM, no network, no base):

- every `python apply.py ...` command they show (in a code block or inline
  code) parses with apply.py's own argument parser, and docs/commands.md
  has a section for every command naming each of its options;
- every repository path they name (`ci/gpu/run.sh`, `tests/patches/x.py`)
  and every relative link exists, and a link's `#anchor` is a heading there;
- docs/series-format.md's tables of directives, keys and trailers list
  exactly what applylib's parser accepts (applylib/core.py's constants);
- README.md's patch table agrees with each patch header's Upstream-Status;
- every command of a block marked ```console docs-run (`$ python apply.py
  ...` lines, each followed by the output the docs show) exits as its
  `# exit N` comment says (none: 0) and prints those lines first; it runs
  from a working directory of links to the project's files, with an empty
  HOME (so an empty tool cache), offline (no git remote, no package index).

    python ci/docs_check.py [--root DIR]

Prints one line per problem and exits 1, or one summary line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

from applylib import core  # noqa: E402
from applylib.cli import parser as apply_parser  # noqa: E402
from applylib.core import UserError  # noqa: E402
from applylib.export import COMPONENT_TESTS  # noqa: E402
from applylib.series import load_patch, parse_series  # noqa: E402

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
COMMAND = re.compile(r"(?:\S*/)?python(?:3(?:\.\d+)?)?\s+apply\.py(?=\s|$)")
SHELL_SPLIT = re.compile(r"\s(?:&&|\|\||\||;)\s|;$")
REDIRECT = re.compile(r"^\d*[<>]")
# Paths the docs name that are not this repository's files: vLLM's test
# folders, where `apply.py export` puts a patch's test; a folder that holds
# only what a person puts there (pack.sh reads it; nothing is kept in git).
NOT_OURS = tuple(f"{d}/" for d in sorted(set(COMPONENT_TESTS.values())))
MADE_BY_HAND = ("ci/gpu/proposed/",)
# The documented output: a fenced block whose info string names docs-run
# holds `$ COMMAND` lines, each followed by the first lines it prints.
RUN_FENCE = re.compile(r"^\s*(```|~~~).*\bdocs-run\b")
EXIT_NOTE = re.compile(r"\s#\s*exit (\d+)\b")  # `$ python apply.py ...  # exit 2`
PYTHON = re.compile(r"(?:\S*/)?python(?:3(?:\.\d+)?)?")
SHELL_WORD = re.compile(r"[|&;<>$`()]")
RUN_TIMEOUT = 20  # seconds: a command the check runs must be quick
PATH_TOKEN = re.compile(r"[\w.~*?<>{}…/+$-]+(?:\[[\w*-]*\])?[\w.~*?<>{}…/+$-]*")


def blank(m: re.Match) -> str:
    """A match's text as spaces, its line breaks kept."""
    return re.sub(r"[^\n]", " ", m.group(0))


@dataclasses.dataclass
class Doc:
    """One Markdown file: its lines, and which of them are in code blocks."""

    path: Path
    rel: str
    lines: list[str]
    in_block: list[bool]

    @classmethod
    def read(cls, path: Path, root: Path) -> Doc:
        lines = path.read_text().splitlines()
        in_block, fenced = [], False
        for line in lines:
            if FENCE.match(line):
                fenced = not fenced
                in_block.append(True)
            else:
                in_block.append(fenced)
        return cls(path, path.relative_to(root).as_posix(), lines, in_block)

    def prose(self) -> str:
        """The text outside code blocks (block lines blanked, so offsets
        still give line numbers)."""
        return "\n".join(
            "" if b else line for line, b in zip(self.lines, self.in_block, strict=True)
        )

    def inline_code(self) -> list[tuple[int, str]]:
        text = self.prose()
        return [
            (text.count("\n", 0, m.start()) + 1, m.group(2).strip())
            for m in INLINE.finditer(text)
        ]

    def plain_text(self) -> list[tuple[int, str]]:
        """The prose lines without inline code and link targets."""
        text = INLINE.sub(blank, self.prose())
        text = LINK.sub(blank, text)
        return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line]

    def block_lines(self) -> list[tuple[int, str]]:
        """Code-block lines, backslash continuations joined."""
        out: list[tuple[int, str]] = []
        joined, start = "", 0
        for n, (line, b) in enumerate(zip(self.lines, self.in_block, strict=True), 1):
            if not b or FENCE.match(line):
                continue
            if not joined:
                start = n
            joined += line
            if line.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            out.append((start, joined))
            joined = ""
        return out

    def headings(self) -> list[tuple[int, str]]:
        return [
            (n, m.group(2))
            for n, (line, b) in enumerate(
                zip(self.lines, self.in_block, strict=True), 1
            )
            if not b and (m := HEADING.match(line))
        ]

    def anchors(self) -> set[str]:
        """GitHub's heading ids: lower case, punctuation dropped, spaces to
        hyphens, repeats numbered."""
        seen: dict[str, int] = {}
        out = set()
        for _, text in self.headings():
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
            slug = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
            slug = slug.replace(" ", "-")
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            out.add(slug if k == 0 else f"{slug}-{k}")
        return out


class Problems(list):
    def add(self, doc: Doc | str, line: int | None, msg: str) -> None:
        where = doc.rel if isinstance(doc, Doc) else doc
        self.append(f"{where}:{line}: {msg}" if line else f"{where}: {msg}")


# --- commands ------------------------------------------------------------


def commands(text: str) -> list[str]:
    """The `python apply.py ...` commands of a shell line, as shown."""
    out = []
    for part in SHELL_SPLIT.split(text):
        m = COMMAND.search(part)
        if m:
            out.append(part[m.start() :].strip())
    return out


def command_args(cmd: str) -> list[str]:
    """The arguments after apply.py, up to a redirection; a bare '...' (more
    arguments) is left out. Placeholders (<tree>, vX.Y.Z) are values."""
    try:
        words = shlex.split(cmd, comments=True)
    except ValueError:
        words = cmd.split("#", 1)[0].split()
    args = []
    for w in words[1 + words.index("apply.py") :]:
        if REDIRECT.match(w) and not re.fullmatch(r"<[^<>]+>\S*", w):
            break
        if w not in ("...", "…"):
            args.append(w)
    return args


@functools.cache
def the_parser() -> argparse.ArgumentParser:
    return apply_parser()


def parse_error(args: list[str]) -> str | None:
    """argparse's complaint about the arguments, or None if they parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            the_parser().parse_args(args)
    except SystemExit as e:
        if e.code not in (0, None):
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else f"exit {e.code}"
    return None


def check_commands(docs: list[Doc], probs: Problems) -> int:
    n = 0
    for doc in docs:
        for line, text in doc.block_lines() + doc.inline_code():
            for cmd in commands(text):
                n += 1
                err = parse_error(command_args(cmd))
                if err:
                    probs.add(doc, line, f"'{cmd}' does not parse: {err}")
    return n


def parser_options(p: argparse.ArgumentParser) -> list[str]:
    """A parser's long options, --help aside."""
    return [
        o
        for a in p._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    ]


def sections(doc: Doc) -> list[tuple[int, str, str]]:
    """(line, heading, text up to the next heading) of each heading."""
    heads = doc.headings() + [(len(doc.lines) + 1, "")]
    return [
        (n, h, "\n".join(doc.lines[n : nxt - 1]))
        for (n, h), (nxt, _) in itertools.pairwise(heads)
    ]


def check_options(root: Path, probs: Problems) -> int:
    """docs/commands.md has a section for every command of the parser (its
    heading names `apply.py COMMAND` or `COMMAND ...`; the main job's says
    "main job"), and
    each of the command's options is named in that section or under
    "Options every command takes"."""
    doc = Doc.read(root / "docs" / "commands.md", root)
    secs = sections(doc)
    shared = "\n".join(t for _, h, t in secs if h == "Options every command takes")
    p = the_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    n = 0
    for name, sp in [("", p), *sub.choices.items()]:
        want = ("main job",) if not name else (f"apply.py {name}", f"`{name} ")
        mine = [(line, f"{h}\n{t}") for line, h, t in secs if any(w in h for w in want)]
        if not mine:
            probs.add(doc, None, f"no section for `{want[0]}` (a heading naming it)")
            continue
        text = "\n".join(t for _, t in mine) + "\n" + shared
        for opt in parser_options(sp):
            n += 1
            if not re.search(re.escape(opt) + r"(?![\w-])", text):
                what = f"apply.py {name}" if name else "the main job"
                probs.add(doc, mine[0][0], f"{what}: {opt} is not documented")
    return n


# --- paths and links -----------------------------------------------------


def top_level(root: Path) -> set[str]:
    """The project's top-level names: what git tracks, else what is there
    and not ignored (so build/ and .venv/ outputs are not paths to check)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = {f.split("/", 1)[0] for f in out.split("\0") if f}
        if names:
            return names
    except (OSError, subprocess.CalledProcessError):
        pass
    ignore = root / ".gitignore"
    ignored = {
        ln.strip().strip("/")
        for ln in (ignore.read_text().splitlines() if ignore.is_file() else [])
    }
    return {p.name for p in root.iterdir()} - ignored - {".git"}


def placeholder(part: str) -> bool:
    """A path component that stands for a name: <name>, NAME, $name, ...,
    vX.Y."""
    return bool(
        re.search(r"[<>{}…$]|\.\.\.|X\.Y", part)
        or (re.search(r"[A-Z]", part) and not re.search(r"[a-z]", part))
    )


def path_missing(root: Path, path: str) -> bool:
    """Whether a repository path named in the docs is absent. A glob must
    match something; a path with placeholders is checked up to them."""
    parts = path.rstrip("/").split("/")
    if (root / path).exists():
        return False
    if any(placeholder(p) for p in parts):
        concrete = []
        for p in parts:
            if placeholder(p):
                break
            concrete.append(p)
        return not (root.joinpath(*concrete)).is_dir()
    if re.search(r"[*?\[]", path):
        return not any(root.glob(path))
    return True


def path_tokens(text: str, top: set[str]) -> list[str]:
    out = []
    for tok in PATH_TOKEN.findall(text):
        tok = tok.split("::", 1)[0].removeprefix("./").rstrip(".,:;")
        if "/" in tok and tok.split("/", 1)[0] in top and "//" not in tok:
            if not (tok + "/").startswith(NOT_OURS + MADE_BY_HAND):
                out.append(tok)
    return out


def check_paths(docs: list[Doc], root: Path, probs: Problems) -> int:
    top = top_level(root)
    n = 0
    for doc in docs:
        for line, text in doc.block_lines() + doc.inline_code() + doc.plain_text():
            for tok in path_tokens(text, top):
                n += 1
                if path_missing(root, tok):
                    probs.add(doc, line, f"no such path in the repository: {tok}")
    return n


def check_links(docs: list[Doc], root: Path, probs: Problems) -> int:
    n = 0
    text_of = {d.path: d for d in docs}
    for doc in docs:
        prose = INLINE.sub(blank, doc.prose())
        for m in LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"[a-zA-Z][\w+.-]*:", target):
                continue  # https:, mailto:
            n += 1
            line = prose.count("\n", 0, m.start()) + 1
            file, _, anchor = target.partition("#")
            path = (doc.path.parent / file).resolve() if file else doc.path
            if not path.exists():
                probs.add(doc, line, f"broken link: {target} (no {file})")
                continue
            if anchor and path.suffix == ".md":
                other = text_of.get(path) or Doc.read(path, path.parent)
                if anchor not in other.anchors():
                    probs.add(doc, line, f"broken link: {target} (no such heading)")
    return n


# --- the spec against the parser ----------------------------------------


def tables(doc: Doc) -> list[tuple[int, str, list[tuple[int, list[str]]]]]:
    """Each table: the heading above it, its first line, its body rows."""
    out: list[tuple[int, str, list[tuple[int, list[str]]]]] = []
    heading, rows, start = "", [], 0
    for n, (line, b) in enumerate(
        zip(doc.lines + [""], doc.in_block + [False], strict=True), 1
    ):
        m = HEADING.match(line) if not b else None
        if m:
            heading = m.group(2).strip()
        if not b and line.lstrip().startswith("|"):
            if not rows:
                start = n
            rows.append((n, re.split(r"(?<!\\)\|", line.strip().strip("|"))))
        elif rows:
            body = [(k, [c.strip() for c in r]) for k, r in rows[2:]]
            out.append((start, heading, body))
            rows = []
    return out


def status_kinds() -> set[str]:
    """The Upstream-Status kinds the lint's pattern accepts."""
    return set(re.findall(r"[(|]([A-Z][a-z]+)", core.UPSTREAM_STATUS.pattern))


# heading of a table in docs/series-format.md -> how its first column names an
# entry, and the entries applylib accepts
SPEC_TABLES = {
    "Directives": (r"`#@ ([\w-]+)", set(core.DIRECTIVES)),
    "Stack keys": (r"`([\w-]+)=", core.STACK_KEYS),
    "Pin keys": (r"`([\w-]+)=", core.PIN_KEYS),
    "Record keys": (r"`([\w-]+)=", core.RECORD_KEYS),
    "Trailers": (
        r"`([\w-]+):",
        set(core.REQUIRED_TRAILERS) | set(core.URL_TRAILERS),
    ),
    "Upstream-Status values": (r"`([A-Z][a-z]+)", status_kinds()),
}


def check_spec(root: Path, probs: Problems) -> int:
    doc = Doc.read(root / "docs" / "series-format.md", root)
    found = {h: (n, rows) for n, h, rows in tables(doc)}
    n = 0
    for heading, (pattern, accepted) in SPEC_TABLES.items():
        if heading not in found:
            probs.add(doc, None, f"no table under the heading '{heading}'")
            continue
        line, rows = found[heading]
        listed = {m.group(1) for _, r in rows if (m := re.match(pattern, r[0]))}
        n += len(listed)
        for extra in sorted(listed - accepted):
            probs.add(doc, line, f"'{heading}' lists {extra}, which applylib rejects")
        for gone in sorted(accepted - listed):
            probs.add(doc, line, f"'{heading}' lacks {gone}, which applylib accepts")
        if heading == "Trailers":
            required = {
                m.group(1)
                for _, r in rows
                if (m := re.match(pattern, r[0])) and r[1].lower().startswith("yes")
            }
            if required != set(core.REQUIRED_TRAILERS):
                probs.add(
                    doc,
                    line,
                    f"'{heading}' marks {sorted(required)} required; apply.py "
                    f"check requires {list(core.REQUIRED_TRAILERS)}",
                )
    return n


# --- README's patch table against the patch headers ---------------------


def row_patches(cell: str) -> list[str]:
    """The patch numbers a row names: `0001`, or a range `0004`-`0007`."""
    m = re.search(r"`(\d{4})`\s*[-–]\s*`(\d{4})`", cell)
    if m:
        return [f"{i:04d}" for i in range(int(m.group(1)), int(m.group(2)) + 1)]
    return re.findall(r"`(\d{4})`", cell)


def status_refs(status: str) -> list[str]:
    """What a README row should name of an Upstream-Status: its PR numbers
    (#N) and commits (first 8 hex digits)."""
    refs = [f"#{n}" for n in re.findall(r"/pull/(\d+)", status)]
    return refs + re.findall(r"/commit/([0-9a-f]{8})", status)


def readme_rows(doc: Doc) -> list[tuple[int, str, str, str]]:
    """(line, stack, patch number, upstream cell) for each patch of the table
    whose first column is the stack."""
    out = []
    for _, _, rows in tables(doc)[:1]:
        stack = ""
        for n, cells in rows:
            m = re.search(r"`([\w.-]+)`", cells[0])
            stack = m.group(1) if m else stack
            out += [(n, stack, p, cells[-1]) for p in row_patches(cells[1])]
    return out


def check_readme(root: Path, probs: Problems) -> int:
    doc = Doc.read(root / "README.md", root)
    series = parse_series(root / "series")
    by_number = {
        (s.name, Path(p).name.split("-", 1)[0]): p
        for s in series.stacks
        for p in s.patches
    }
    seen: set[str] = set()
    for n, stack, number, cell in readme_rows(doc):
        entry = by_number.get((stack, number))
        if entry is None:
            probs.add(doc, n, f"patch table: {stack}/{number} is not in series")
            continue
        seen.add(entry)
        status = (load_patch(series, entry).values("Upstream-Status") or [""])[0]
        kind = status.split(" ", 1)[0]
        said = re.match(r"\W*(\w+)", cell)
        if not said or said.group(1) != kind:
            probs.add(
                doc,
                n,
                f"patch table: {stack}/{number} says "
                f"'{said.group(1) if said else cell}', its header "
                f"'Upstream-Status: {status}'",
            )
        for ref in status_refs(status):
            if ref not in cell:
                probs.add(doc, n, f"patch table: {stack}/{number} does not name {ref}")
    for s in series.stacks:
        for p in s.patches:
            if p not in seen:
                probs.add(doc, None, f"patch table: no row for {p}")
    return len(seen)


# --- documented output ----------------------------------------------------


@dataclasses.dataclass
class Run:
    """One `$ COMMAND` line of a docs-run block: its exit code (the
    `# exit N` comment; none: 0) and the output lines shown under it, up to
    a `...` line (line number, text)."""

    doc: Doc
    line: int
    cmd: str
    exit: int
    shown: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    more: bool = False


def run_blocks(doc: Doc) -> list[tuple[int, list[tuple[int, str]]]]:
    """(fence line, its lines) of each docs-run block, a `$` line's
    backslash continuations joined."""
    blocks: list[tuple[int, list[tuple[int, str]]]] = []
    cur: list[tuple[int, str]] | None = None
    fenced = False
    for n, line in enumerate(doc.lines, 1):
        if FENCE.match(line):
            fenced = not fenced
            cur = [] if fenced and RUN_FENCE.match(line) else None
            if cur is not None:
                blocks.append((n, cur))
        elif cur is not None:
            if cur and cur[-1][1].startswith("$ ") and cur[-1][1].endswith("\\"):
                cur[-1] = (cur[-1][0], cur[-1][1][:-1].rstrip() + " " + line.strip())
            else:
                cur.append((n, line.rstrip()))
    return blocks


def runs(doc: Doc, probs: Problems) -> list[Run]:
    """The commands of the doc's docs-run blocks with what the docs show."""
    out: list[Run] = []
    for fence, lines in run_blocks(doc):
        cur: Run | None = None
        for n, text in lines:
            if text.startswith("$ "):
                note = EXIT_NOTE.search(text)
                cmd = text[2:].split(" #", 1)[0].strip()
                cur = Run(doc, n, cmd, int(note.group(1)) if note else 0)
                out.append(cur)
            elif cur is None:
                if text:
                    probs.add(doc, n, "docs-run: output before any '$ ' command")
            elif text.strip() in ("...", "…"):
                cur.more = True
            elif not cur.more:
                cur.shown.append((n, text))
        if cur is None:
            probs.add(doc, fence, "docs-run block without a '$ ' command")
    for run in out:
        while run.shown and not run.shown[-1][1]:
            run.shown.pop()
    return out


def run_args(cmd: str) -> list[str] | None:
    """apply.py's arguments, or None when the command is not `python
    apply.py ARGS` alone (a pipe, a redirection, a variable)."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        return None
    if len(words) < 2 or not PYTHON.fullmatch(words[0]) or words[1] != "apply.py":
        return None
    if any(SHELL_WORD.search(w) for w in words[2:]):
        return None
    return words[2:]


def interpreter(root: Path) -> str:
    """The project's .venv Python (the root's, else this checkout's), else
    the one running the check."""
    for base in (root, PROJECT):
        py = base / ".venv" / "bin" / "python"
        if py.exists():
            return str(py)
    return sys.executable


def run_env(home: Path) -> dict[str, str]:
    """A documented command's whole environment: nothing of the caller's
    (no VLLM_REPO, cache or pinned files) but PATH."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),  # so the tool's cache, ~/.cache/vllm-patches, is empty
        "LANG": "C.UTF-8",
        "COLUMNS": "80",  # argparse's usage lines
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",  # stdout and stderr in order, as on a terminal
        "PYTHONDONTWRITEBYTECODE": "1",
        "VLLM_PATCHES_OFFLINE": "1",  # no git remote
        "PIP_NO_INDEX": "1",  # no package index: a release download fails at once
        "GIT_CONFIG_NOSYSTEM": "1",
    }


def normalize(text: str, paths: dict[Path, str]) -> list[str]:
    """The output's lines, each of `paths` written as the docs write it
    (the home as ~, the working directory and the project as .), trailing
    blanks dropped: nothing else is normalized."""
    for path, short in sorted(paths.items(), key=lambda kv: -len(str(kv[0]))):
        text = re.sub(re.escape(str(path)) + r"(?![\w.-])", short, text)
    return [ln.rstrip() for ln in text.splitlines()]


def run_one(args: list[str], root: Path, top: set[str]) -> tuple[int | None, list[str]]:
    """`python apply.py ARGS` with an empty home, from a directory of links
    to the project's top-level files (a checkout's ./vllm, build/ or dist/
    are not there): the exit code (None past RUN_TIMEOUT) and the output."""
    with tempfile.TemporaryDirectory(prefix="docs-run-") as t:
        home, work = Path(t).resolve() / "home", Path(t).resolve() / "work"
        home.mkdir()
        work.mkdir()
        for name in top:
            (work / name).symlink_to(root / name)
        tilde = [str(home) + a[1:] if a == "~" or a[:2] == "~/" else a for a in args]
        with subprocess.Popen(
            [interpreter(root), "apply.py", *tilde],
            cwd=work,
            env=run_env(home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ) as p:
            try:
                out, _ = p.communicate(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
                return None, []
        got = normalize(out.decode(errors="replace"), {home: "~", work: ".", root: "."})
        return p.returncode, got


def compare(run: Run, code: int | None, got: list[str], probs: Problems) -> None:
    """One line per difference from the docs: the exit code, then the
    first shown line that differs."""
    ran = f"ran '{run.cmd}'"
    if code is None:
        msg = f"{ran}: still running after {RUN_TIMEOUT} s (docs-run must be quick)"
        probs.add(run.doc, run.line, msg)
        return
    if code != run.exit:
        probs.add(run.doc, run.line, f"{ran}: exit {code} (docs: {run.exit})")
    for k, (n, want) in enumerate(run.shown):
        which = "first line" if k == 0 else f"line {k + 1}"
        if k >= len(got):
            probs.add(run.doc, n, f"{ran}: no {which}, the output ends (docs: '{want}')")
            return
        if got[k] != want:
            probs.add(run.doc, n, f"{ran}: {which} '{got[k]}' (docs: '{want}')")
            return


def check_runs(docs: list[Doc], root: Path, probs: Problems) -> int:
    """Run every docs-run command (side by side) and compare."""
    todo: list[tuple[Run, list[str]]] = []
    for doc in docs:
        for run in runs(doc, probs):
            args = run_args(run.cmd)
            if args is None:
                probs.add(
                    doc,
                    run.line,
                    f"docs-run: '{run.cmd}' is not `python apply.py ARGS` alone "
                    "(no pipe, redirection or variable)",
                )
            else:
                todo.append((run, args))
    top = top_level(root)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        done = list(pool.map(lambda t: run_one(t[1], root, top), todo))
    for (run, _), (code, got) in zip(todo, done, strict=True):
        compare(run, code, got, probs)
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Check that README.md and docs/*.md agree with the code."
    )
    ap.add_argument("--root", type=Path, default=PROJECT, help="project root")
    root = ap.parse_args(argv).root.resolve()
    top = [root / "README.md", root / "CHANGELOG.md"]
    docs = [Doc.read(p, root) for p in top if p.is_file()] + [
        Doc.read(p, root) for p in sorted((root / "docs").glob("*.md"))
    ]
    probs = Problems()
    cmds = check_commands(docs, probs)
    opts = check_options(root, probs)
    paths = check_paths(docs, root, probs)
    links = check_links(docs, root, probs)
    try:
        spec = check_spec(root, probs)
        rows = check_readme(root, probs)
    except (UserError, OSError) as e:
        probs.add("series", None, str(e))
        spec = rows = 0
    ran = check_runs(docs, root, probs)
    for p in probs:
        print(p)
    if probs:
        return 1
    print(
        f"docs check: {len(docs)} files: {cmds} apply.py commands parse, "
        f"{opts} options documented, "
        f"{paths} paths and {links} links exist, the spec's {spec} directives, "
        f"keys and trailers are the parser's, {rows} patches' README rows "
        f"match their Upstream-Status, {ran} documented commands exit and "
        "print as shown: ok"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
