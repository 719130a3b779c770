"""The series file, its stacks and records, and the patch files."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import shlex
from pathlib import Path, PurePosixPath

from .core import (
    DIRECTIVES,
    PIN_KEYS,
    RECORD_KEYS,
    RECORDS,
    REQUIRED_TRAILERS,
    SPDX,
    STACK_KEYS,
    UPSTREAM_STATUS,
    UPSTREAM_URL,
    URL_TRAILERS,
    ZERO_FROM,
    UserError,
    git,
)


@dataclasses.dataclass
class Stack:
    name: str
    pins: dict[str, str]
    patches: list[str]
    lineno: int
    not_needed: list[dict[str, str]] = dataclasses.field(default_factory=list)
    patch_lines: dict[str, int] = dataclasses.field(default_factory=dict)

    file_pins: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    patches_dir: Path | None = None  # where its patch files are (patches/)

    def fetch_hint(self, into: Path) -> str:
        """The git fetch command(s) that get the stack's base (and the
        per-patch pins' commits) into a repository."""
        cmds = []
        for pins in [self.pins, *self.file_pins.values()]:
            repo = pins.get("repo", UPSTREAM_URL)
            what = pins.get("fetch") or pins.get("commit") or pins.get("tag", "")
            cmd = f"git -C {into} fetch {repo} {what}"
            if cmd not in cmds:
                cmds.append(cmd)
        return " && ".join(cmds)


@dataclasses.dataclass
class Series:
    path: Path
    stacks: list[Stack]

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    def stack(self, name: str | None) -> Stack:
        if name is None:
            return self.stacks[0]
        for s in self.stacks:
            if s.name == name:
                return s
        names = ", ".join(s.name for s in self.stacks)
        raise UserError(f"unknown stack '{name}' (the series has: {names})")

    def pick_stack(self, name: str | None, base: str | None) -> Stack:
        """--stack NAME, else the stack a --base means, else the first."""
        if name or not base:
            return self.stack(name)
        return self.stack_for_base(base)

    def released(self) -> list[tuple[tuple[int, ...], Stack]]:
        """The stacks pinned to a release, oldest pin first, by its key."""
        keyed = [(release_key(s.pins.get("tag", "")), s) for s in self.stacks]
        return sorted(((k, s) for k, s in keyed if k), key=lambda ks: ks[0])

    def stack_for_base(self, base: str) -> Stack:
        """The stack a bare --base means: the one pinned to that tag, else the
        one pinned to the newest release before it, else the oldest pinned
        (a release before every pin), else the first."""
        want, released = release_key(base), self.released()
        exact = [s for k, s in released if k == want]
        if exact or not want:
            return (exact or self.stacks)[0]
        before = [s for k, s in released if k < want] or [s for _, s in released[:1]]
        return before[-1] if before else self.stacks[0]

    def pins_around(self, base: str) -> tuple[Stack, Stack] | None:
        """The stacks pinned to the newest release before `base` and the
        oldest after it, when `base` is a release between two pins."""
        want = release_key(base)
        if not want:
            return None
        released = self.released()
        before = [s for k, s in released if k < want]
        after = [s for k, s in released if k > want]
        return (before[-1], after[0]) if before and after else None

    def digest(self, stack: Stack) -> str:
        h = hashlib.sha256()
        for p in stack.patches:
            h.update(p.encode() + b"\0" + (self.patches_dir / p).read_bytes())
        return h.hexdigest()


def short_name(file: str) -> str:
    """A patch's short name: its stack folder and number (tq-v0.33/0001)."""
    folder, _, name = file.rpartition("/")
    return (folder + "/" if folder else "") + name.split("-", 1)[0]


def release_key(rev: str) -> tuple[int, ...] | None:
    """(X, Y, Z) of a release tag vX.Y.Z, else None."""
    m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", rev)
    return tuple(map(int, m.groups())) if m else None


def parse_series(path: Path, need_patches: bool = True) -> Series:
    """The series file, read and checked: its stacks, patches and records."""
    if not path.is_file():
        raise UserError(f"{path}: series file not found")
    stacks: list[Stack] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        where = f"{path.name}:{n}"
        if line.startswith("#@"):
            parse_directive(where, line, stacks, path, n)
        elif line and not line.startswith("#"):
            add_series_entry(where, line, stacks, seen, n)
    check_series(path, stacks, need_patches)
    return Series(path.resolve(), stacks)


def directive_words(where: str, line: str) -> tuple[str, list[str], dict[str, str]]:
    """A '#@' line's kind, its words after the kind, and its key=value words."""
    try:
        words = shlex.split(line[2:])
    except ValueError as e:
        raise UserError(f"{where}: malformed directive: {e}") from None
    if not words:
        raise UserError(f"{where}: empty '#@' directive")
    kind, rest = words[0], words[1:]
    kv: dict[str, str] = {}
    for w in rest[1:]:
        if "=" not in w:
            raise UserError(
                f"{where}: malformed directive: expected key=value, got '{w}'"
            )
        k, v = w.split("=", 1)
        kv[k] = v
    return kind, rest, kv


def parse_directive(
    where: str, line: str, stacks: list[Stack], path: Path, n: int
) -> None:
    """One '#@' line: a new stack, a patch's own pin, or a patch record."""
    kind, rest, kv = directive_words(where, line)
    if kind not in DIRECTIVES:
        raise UserError(f"{where}: unknown directive '#@ {kind}'")
    if kind == "stack":
        stacks.append(parse_stack(where, rest, kv, stacks, path, n))
    elif kind == "pin":
        if not stacks or not rest or "=" in rest[0] or set(kv) - PIN_KEYS:
            raise UserError(
                f"{where}: malformed directive: '#@ pin "
                "PATCH repo=URL commit=<40 hex> [branch=]'"
            )
        if not re.fullmatch(r"[0-9a-f]{40}", kv.get("commit", "")):
            raise UserError(f"{where}: commit= must be 40 hex digits")
        stacks[-1].file_pins[rest[0]] = kv
    elif kind in RECORDS:
        if not stacks or not rest or "=" in rest[0] or set(kv) - RECORD_KEYS:
            raise UserError(
                f"{where}: malformed directive: '#@ {kind} PATCH base=REV reason=...'"
            )
        if not kv.get("base"):
            raise UserError(f"{where}: '#@ {kind}' needs base= (where it was decided)")
        rec = {"file": rest[0], "kind": kind, **kv, "_line": str(n)}
        stacks[-1].not_needed.append(rec)


def add_series_entry(
    where: str, line: str, stacks: list[Stack], seen: dict[str, int], n: int
) -> None:
    """One patch line: the patch joins the last stack, once in the series."""
    fields = line.split()
    entry = fields[0]
    if any(f not in ("-p1",) for f in fields[1:]):
        raise UserError(f"{where}: unsupported quilt option in '{line}'")
    if not stacks:
        raise UserError(
            f"{where}: patch '{entry}' comes before any '#@ stack' directive"
        )
    if entry in seen:
        raise UserError(
            f"{where}: '{entry}' listed twice (first at line {seen[entry]})"
        )
    seen[entry] = n
    check_safe_relpath(entry, f"{where}: series entry")
    stacks[-1].patches.append(entry)
    stacks[-1].patch_lines[entry] = n


def check_series(path: Path, stacks: list[Stack], need_patches: bool) -> None:
    """The whole file's checks: pins name patches, patches listed exist."""
    for s in stacks:
        for f in s.file_pins:
            if f not in s.patches:
                raise UserError(
                    f"{path.name}: '#@ pin {f}': not a patch of stack '{s.name}'"
                )
    if not stacks or (need_patches and not any(s.patches for s in stacks)):
        raise UserError(f"{path}: the series lists no patch")
    for s in stacks:
        for p in s.patches:
            if not (path.parent / "patches" / p).is_file():
                raise UserError(
                    f"{path.name}: '{p}' is listed but patches/{p} does not exist"
                )


def parse_stack(
    where: str,
    rest: list[str],
    kv: dict[str, str],
    stacks: list[Stack],
    path: Path,
    n: int,
) -> Stack:
    """One '#@ stack NAME key=value ...' directive, checked."""
    if not rest or "=" in rest[0]:
        raise UserError(f"{where}: malformed directive: '#@ stack NAME key=value ...'")
    name = rest[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"{where}: bad stack name '{name}'")
    bad = set(kv) - STACK_KEYS
    if bad:
        raise UserError(
            f"{where}: malformed directive: unknown key '{min(bad)}' "
            f"(known: {', '.join(sorted(STACK_KEYS))})"
        )
    if not ({"commit", "tag", "branch"} & set(kv)):
        raise UserError(
            f"{where}: stack '{name}' pins no base (give commit=, tag= or branch=)"
        )
    if "commit" in kv and not re.fullmatch(r"[0-9a-f]{40}", kv["commit"]):
        raise UserError(f"{where}: commit= must be 40 hex digits")
    if "assemble" in kv and not re.fullmatch(
        r"v\d+\.\d+\.\d+(?:\.post\d+)?", kv["assemble"]
    ):
        raise UserError(
            f"{where}: assemble= must name a release, vX.Y.Z (got '{kv['assemble']}')"
        )
    if "assemble" in kv and "commit" not in kv:
        raise UserError(
            f"{where}: assemble= needs the stack's commit= (the pin of the "
            "files its patches change)"
        )
    if any(s.name == name for s in stacks):
        raise UserError(f"{where}: stack '{name}' defined twice")
    return Stack(name, kv, [], n, patches_dir=path.resolve().parent / "patches")


def check_safe_relpath(p: str, what: str) -> None:
    pp = PurePosixPath(p)
    if (
        pp.is_absolute()
        or ".." in pp.parts
        or ".git" in pp.parts
        or "\\" in p
        or not pp.parts
    ):
        raise UserError(f"{what} '{p}' is not a safe relative path")


@dataclasses.dataclass
class Patch:
    file: str
    path: Path
    subject: str
    body: str
    files: list[str]
    raw: bytes

    @functools.cached_property
    def trailers(self) -> list[tuple[str, str]]:
        """(key, value) pairs, as git interpret-trailers parses them (asked
        for only when needed: applying alone does not read them)."""
        proc = git(
            "interpret-trailers",
            "--parse",
            "--no-divider",
            input=self.body.encode(),
            cwd=self.path.parent,
        )
        out = []
        for line in proc.stdout.decode().splitlines():
            k, _, v = line.partition(":")
            out.append((k.strip(), v.strip()))
        return out

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.trailers if k.lower() == key.lower()]

    @property
    def regression(self) -> list[str]:
        tests = self.values("Tests")
        return tests[0].split() if tests else []

    @property
    def tests(self) -> list[str]:
        out: list[str] = []
        for t in self.values("Tests"):
            out += [x for x in t.split() if x not in out]
        return out


DIFF_GIT = re.compile(rb"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def load_patch(series: Series, entry: str) -> Patch:
    path = series.patches_dir / entry
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"patches/{entry}: not UTF-8 text") from None
    head, sep, _ = text.partition("\n---\n")
    if not raw.startswith(b"From ") or not sep or b"\ndiff --git " not in raw:
        raise UserError(
            f"patches/{entry}: not a git format-patch file "
            "(no mbox header, '---' line or diff)"
        )
    m = re.search(r"^Subject: (.*(?:\n [^\n]*)*)$", head, re.MULTILINE)
    subject = re.sub(r"\n ", " ", m.group(1)) if m else ""
    body = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    files = []
    for a, b in DIFF_GIT.findall(raw):
        for f in (a.decode(), b.decode()):
            if f not in files:
                files.append(f)
    for f in files:
        check_safe_relpath(f, f"patches/{entry}: touches")
    if b"\nGIT binary patch\n" in raw or re.search(
        rb"^Binary files ", raw, re.MULTILINE
    ):
        raise UserError(f"patches/{entry}: binary diff (patches must be text)")
    return Patch(entry, path, subject, body, files, raw)


def lint_patch(series: Series, p: Patch) -> list[str]:
    """Problems with one patch's headers and content, as messages."""
    probs = []
    where = f"patches/{p.file}"
    if not p.raw.startswith(ZERO_FROM):
        probs.append(
            f"{where}: not exported with --zero-commit (use 'apply.py format-patch')"
        )
    if re.search(rb"^index [0-9a-f]{7,39}\.\.", p.raw, re.MULTILINE) and not re.search(
        rb"^index [0-9a-f]{40}\.\.[0-9a-f]{40}", p.raw, re.MULTILINE
    ):
        probs.append(f"{where}: index lines are abbreviated (use --full-index)")
    if re.search(rb"\n-- \n[0-9][^\n]*\n*\Z", p.raw):
        probs.append(f"{where}: ends with a git version signature")
    if not p.subject or not re.match(r"^\[[^\]]+\]", p.subject):
        probs.append(
            f"{where}: subject needs a component prefix like "
            "'[Attention][TurboQuant] ...'"
        )
    for key in REQUIRED_TRAILERS:
        if key != "Upstream-Status" and not p.values(key):
            probs.append(f"{where}: no '{key}:' trailer")
    for b in p.values("Bug"):
        if not re.match(r"^https?://\S+$", b):
            probs.append(f"{where}: 'Bug: {b}' is not a URL")
    st = p.values("Upstream-Status")
    if len(st) != 1:
        probs.append(f"{where}: needs exactly one 'Upstream-Status:' trailer")
    elif not UPSTREAM_STATUS.match(st[0]):
        probs.append(
            f"{where}: invalid 'Upstream-Status: {st[0]}' (Pending | "
            "Submitted [URL] | Backport [ref] | Inappropriate [reason])"
        )
    for key in URL_TRAILERS:
        for v in p.values(key):
            if not re.match(r"^https?://\S+", v):
                probs.append(f"{where}: '{key}: {v}' does not start with a URL")
    for t in p.tests:
        f = t.split("::", 1)[0]
        try:
            check_safe_relpath(f, "test")
        except UserError:
            probs.append(f"{where}: test '{t}' is not a path in this project")
            continue
        if not (series.root / f).is_file():
            probs.append(f"{where}: test file '{f}' does not exist")
    probs += lint_new_python_files(p)
    probs += lint_signatures(series, p)
    return probs


def signed_tests(path: Path) -> dict[str, bool]:
    """Test functions of a module (and of its classes, as Class::name), and
    whether each declares a bug signature (@pytest.mark.bug_signature)."""
    import ast

    out: dict[str, bool] = {}

    def visit(body: list, prefix: str, marked: bool) -> None:
        for n in body:
            deco = [ast.unparse(d) for d in getattr(n, "decorator_list", [])]
            here = marked or any("mark.bug_signature(" in d for d in deco)
            if isinstance(n, ast.ClassDef):
                visit(n.body, f"{prefix}{n.name}::", here)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + n.name] = here

    visit(ast.parse(path.read_text()).body, "", False)
    return out


def lint_signatures(series: Series, p: Patch) -> list[str]:
    """Every regression test declares the bug's signature: without one its
    failure cannot be told from a broken test."""
    probs = []
    for t in p.regression:
        f, _, name = t.partition("::")
        path = series.root / f
        if not path.is_file():
            continue
        tests = signed_tests(path)
        names = [n for n in tests if not name or n == name.split("[")[0]]
        if not names:
            probs.append(f"patches/{p.file}: regression test '{t}' not found")
        for n in names:
            if n.split("::")[-1].startswith("test") and not tests[n]:
                probs.append(
                    f"patches/{p.file}: regression test {f}::{n} declares no "
                    "bug signature (@pytest.mark.bug_signature(Exc, pattern))"
                )
    return probs


def lint_new_python_files(p: Patch) -> list[str]:
    probs = []
    for block in re.split(rb"(?m)^(?=diff --git )", p.raw):
        m = DIFF_GIT.match(block)
        if not m or b"\nnew file mode " not in block.split(b"\n@@", 1)[0]:
            continue
        name = m.group(2).decode()
        if not name.endswith(".py"):
            continue
        added = [
            ln[1:].decode()
            for ln in block.split(b"\n")
            if ln.startswith(b"+") and not ln.startswith(b"+++")
        ]
        if tuple(added[:2]) != SPDX and added:
            probs.append(
                f"patches/{p.file}: new file {name} lacks vLLM's SPDX header lines"
            )
    return probs


def check_agreement(series: Series) -> None:
    """Every patch file is in the series (or recorded there), and vice versa."""
    listed = {p for s in series.stacks for p in s.patches}
    recorded = {r["file"] for s in series.stacks for r in s.not_needed}
    on_disk = {
        p.relative_to(series.patches_dir).as_posix()
        for p in series.patches_dir.rglob("*.patch")
    }
    for extra in sorted(on_disk - listed - recorded):
        raise UserError(
            f"patches/{extra} is not in the series (list it, or remove the file)"
        )
    for gone in sorted(recorded - on_disk):
        raise UserError(f"series: record for missing patches/{gone}")


def stale_status(series: Series) -> list[str]:
    """Patches the series records not-needed on a later base (their fix is
    upstream there) whose header still says 'Upstream-Status: Pending'."""
    notes = []
    for st in series.stacks:
        for rec in st.not_needed:
            p = load_patch(series, rec["file"])
            if (p.values("Upstream-Status") or [""])[0] == "Pending":
                notes.append(
                    f"warning: patches/{rec['file']} is not needed on "
                    f"{rec['base']} (stack {st.name}) but says 'Upstream-Status: "
                    "Pending': name the upstream fix (Backport [...])"
                )
    return notes


def pick_patch(series: Series, want: str) -> tuple[Stack, str]:
    """The one patch of the series that `want` names: its entry, or a prefix
    of its entry (tq/0002) or of its file name (0002-turboquant)."""
    found = [
        (s, e)
        for s in series.stacks
        for e in s.patches
        if e.startswith(want) or Path(e).name.startswith(want)
    ]
    if len(found) != 1:
        what = (
            "no patch of the series matches"
            if not found
            else f"{len(found)} patches of the series match"
        )
        raise UserError(
            f"'{want}': {what} (give the file "
            "name, e.g. tq/0001-....patch, or a unique prefix)"
        )
    return found[0]
