"""What a rebase writes into the project: the rebased patch files, and the
series with the stack re-pinned to its new base (or a new stack beside it)
and records of the patches that did not come along."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from .bases import RELEASE_TAG, Base
from .core import STACK_KEYS, atomic_write
from .series import Series, Stack


def stack_directive(name: str, pins: dict[str, str]) -> str:
    """The '#@ stack' line of a stack with these pins (every key the parser
    takes, in the spec's order)."""
    order = ["repo", "tag", "branch", "commit", "upstream", "fetch", "assemble"]
    assert set(order) == STACK_KEYS, "stack keys out of step with the parser"
    return " ".join(
        [f"#@ stack {name}"]
        + [f"{k}={shlex.quote(pins[k])}" for k in order if pins.get(k)]
    )


def record_line(rec: dict[str, str]) -> str:
    """The '#@ not-needed' / '#@ dropped' line of a record."""
    extra = "".join(
        f" {k}={shlex.quote(v)}"
        for k, v in rec.items()
        if k not in ("file", "kind") and not k.startswith("_")
    )
    return f"#@ {rec['kind']} {rec['file']}{extra}\n"


def last_line(stack: Stack) -> int:
    """The stack's last line in the series: its directive, a patch or a
    record."""
    return max(
        [
            stack.lineno,
            *stack.patch_lines.values(),
            *(int(r.get("_line", 0)) for r in stack.not_needed),
        ]
    )


def rewrite_series(
    series: Series, stack: Stack, pins: dict[str, str], records: list[dict[str, str]]
) -> str:
    """The series text with the stack re-pinned and `records` taken out of
    its active list (kept as '#@ not-needed' / '#@ dropped' lines)."""
    lines = series.path.read_text().splitlines(keepends=True)
    gone = {stack.patch_lines[r["file"]] for r in records}
    last = last_line(stack)
    out = []
    for n, line in enumerate(lines, 1):
        if n == stack.lineno:
            out.append(stack_directive(stack.name, pins) + "\n")
        elif n not in gone:
            out.append(line if line.endswith("\n") else line + "\n")
        if n == last:
            out += [record_line(r) for r in records]
    return "".join(out)


def add_stack(
    series: Series,
    stack: Stack,
    name: str,
    pins: dict[str, str],
    entries: list[str],
    records: list[dict[str, str]],
) -> str:
    """The series text with a new stack `name` after `stack`: the same
    patches carried to a new base (`entries`, under patches/<name>/), and
    `records` for those that did not come along; `stack` stays as it was."""
    lines = series.path.read_text().splitlines(keepends=True)
    last = last_line(stack)
    block = [
        "\n",
        (
            f"# The '{stack.name}' stack carried to "
            f"{pins.get('tag') or pins.get('commit')} by apply.py rebase.\n"
        ),
        stack_directive(name, pins) + "\n",
        *(e + "\n" for e in entries),
        *(record_line(r) for r in records),
    ]
    out = [ln if ln.endswith("\n") else ln + "\n" for ln in lines]
    return "".join(out[:last] + block + out[last:])


def new_pins(stack: Stack, base: Base) -> dict[str, str]:
    """The stack's pins at its new base."""
    pins = {
        k: v
        for k, v in stack.pins.items()
        if k not in ("tag", "branch", "commit", "upstream", "fetch", "assemble")
    }
    if RELEASE_TAG.match(base.rev):
        pins["tag"] = base.rev if base.rev.startswith("v") else f"v{base.rev}"
    elif not re.fullmatch(r"[0-9a-f]{7,40}", base.rev):
        pins["branch"] = base.rev
    if base.source in ("repo", "remote"):
        pins["commit"] = base.commit
    elif base.upstream_commit:
        # a release materialized from its wheel: the wheel names the upstream
        # commit (often abbreviated); the full id is not known offline
        pins["upstream"] = base.upstream_commit
    return pins


def write_patches(
    series: Series,
    stack: Stack,
    pins: dict[str, str],
    records: list[dict[str, str]],
    staged: dict[str, str],
    into: str | None,
) -> str:
    """Put the staged patch files (patch -> the file staged for it) in place;
    the new series text. With --as NAME (`into`) they go to patches/NAME/
    and a new stack NAME is added, the rebased stack staying as it was."""
    entries = []
    for f, staged_file in staged.items():
        dest = f"{into}/{Path(f).name}" if into else f
        entries.append(dest)
        path = series.patches_dir / dest
        data = Path(staged_file).read_bytes()
        if not path.exists() or data != path.read_bytes():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
    if into:
        return add_stack(series, stack, into, pins, entries, records)
    return rewrite_series(series, stack, pins, records)
