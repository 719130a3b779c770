"""ci/docs_check.py: the docs agree with the code.

It passes on the project as it is; on a copy of the project with a broken
command, a missing path, a broken link, a spec table that drifted from the
parser, a README row that contradicts a patch header, or a documented
command (a `console docs-run` block) whose exit code or first output lines
the tool no longer gives, it fails with one line per problem naming the file
and line (each planted problem, and only those, is new against a run on the
unplanted copy).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

CHECK = ROOT / "ci" / "docs_check.py"


def run_check(root: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(CHECK)] + (["--root", str(root)] if root else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the project's tracked files (not a git repository)."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"],
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    root = tmp_path / "project"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, root / f)
    return root


def lines_of(p: subprocess.CompletedProcess[str]) -> list[str]:
    return p.stdout.splitlines()


def planted(project: Path, before: list[str]) -> list[str]:
    """The problems the check finds in `project` that it did not find
    before (whatever else the docs may have wrong at the time)."""
    p = run_check(project)
    assert p.returncode == 1, p.stdout + p.stderr
    return [ln for ln in lines_of(p) if ln not in before]


def test_real_docs_pass() -> None:
    p = run_check()
    assert p.returncode == 0, p.stdout + p.stderr
    assert lines_of(p) == [lines_of(p)[0]]
    assert lines_of(p)[0].startswith("docs check: ")
    assert lines_of(p)[0].endswith(": ok")
    ran = re.search(r", (\d+) documented commands exit and print as shown: ok$",
                    lines_of(p)[0])
    assert ran and int(ran.group(1)) >= 8, lines_of(p)


def test_copy_passes(project: Path) -> None:
    p = run_check(project)
    assert p.returncode == 0, p.stdout + p.stderr


def test_broken_command_path_and_link(project: Path) -> None:
    before = lines_of(run_check(project))
    doc = project / "docs" / "commands.md"
    n = len(doc.read_text().splitlines())
    with doc.open("a") as f:
        f.write(
            "\n```bash\n"  # n + 1, n + 2
            "python apply.py mutants --no-such-flag\n"  # n + 3
            "python apply.py frobnicate tq/0001\n"  # n + 4
            "python apply.py test --tree <tree> tq/0002   # placeholders parse\n"
            "```\n"
            "\n"
            "Run `ci/gpu/no-such-script.sh` first; see [there](nowhere.md)\n"
            "and [this](verdicts.md#no-such-heading).\n"  # n + 9
        )
    out = planted(project, before)
    assert len(out) == 5, out
    assert out[0].startswith(
        f"docs/commands.md:{n + 3}: 'python apply.py mutants --no-such-flag' "
        "does not parse: "
    )
    assert "unrecognized arguments: --no-such-flag" in out[0]
    assert out[1].startswith(
        f"docs/commands.md:{n + 4}: 'python apply.py frobnicate tq/0001' "
        "does not parse: "
    )
    assert "invalid choice: 'frobnicate'" in out[1]
    assert out[2] == (
        f"docs/commands.md:{n + 8}: no such path in the repository: "
        "ci/gpu/no-such-script.sh"
    )
    assert out[3] == (
        f"docs/commands.md:{n + 8}: broken link: nowhere.md (no nowhere.md)"
    )
    assert out[4] == (
        f"docs/commands.md:{n + 9}: broken link: verdicts.md#no-such-heading "
        "(no such heading)"
    )


def test_spec_that_drifted_from_the_parser(project: Path) -> None:
    before = lines_of(run_check(project))
    doc = project / "docs" / "series-format.md"
    text = doc.read_text()
    row = "| `fetch=` | ref or commit | base resolution, fetch hints |"
    assert row in text
    text = text.replace(row, "| `pypi=` | name | nothing |\n" + row)
    text = "\n".join(
        ln for ln in text.splitlines() if not ln.startswith("| `Related:` |")
    )
    doc.write_text(text + "\n")
    out = planted(project, before)
    assert len(out) == 2, out
    assert out[0].endswith("'Stack keys' lists pypi, which applylib rejects")
    assert out[1].endswith("'Trailers' lacks Related, which applylib accepts")


def test_readme_row_against_the_patch_header(project: Path) -> None:
    before = lines_of(run_check(project))
    readme = project / "README.md"
    text = readme.read_text()
    assert "| Backport of #41434, in v0.21.0 |" in text
    text = text.replace("| Backport of #41434, in v0.21.0 |", "| Pending |")
    text = "\n".join(
        ln for ln in text.splitlines() if "ChuanLi1101/vllm f9ae8f4d" not in ln
    )
    readme.write_text(text + "\n")
    out = planted(project, before)
    assert len(out) == 3, out
    assert any(
        "patch table: tq/0002 says 'Pending', its header 'Upstream-Status: "
        "Backport [" in ln
        for ln in out
    ), out
    assert any("patch table: tq/0002 does not name #41434" in ln for ln in out)
    assert out[-1] == (
        "README.md: patch table: no row for "
        "dsv4/0002-rocm-dsv4-compressor-first-token-rope.patch"
    )


def test_option_missing_from_the_docs(project: Path) -> None:
    """An option the parser has and commands.md does not name, in the
    section of its command (the copy's own parser, so a new option planted
    there counts), and a command without a section: one line each."""
    before = lines_of(run_check(project))
    cli = project / "applylib" / "cli.py"
    cli.write_text(cli.read_text().replace(
        '    p.add_argument("--no-tests", action="store_true", help="apply only")',
        '    p.add_argument("--no-tests", action="store_true", help="apply only")\n'
        '    p.add_argument("--frobnicate", action="store_true")', 1))
    doc = project / "docs" / "commands.md"
    text = doc.read_text()
    at = text.index("### `apply.py export")
    end = text.index("### `apply.py mutants")
    doc.write_text(text[:at] + text[at:end].replace("--onto", "--onward") + text[end:]
                   .replace("### `apply.py mutants", "### Mutants of"))
    p = subprocess.run([sys.executable, str(project / "ci" / "docs_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    new = [ln for ln in lines_of(p) if ln not in before]
    line = text[:at].count("\n") + 1
    main_job = text[: text.index("### The main job")].count("\n") + 1
    assert sorted(new) == sorted([
        f"docs/commands.md:{main_job}: the main job: --frobnicate is not documented",
        f"docs/commands.md:{line}: apply.py export: --onto is not documented",
        "docs/commands.md: no section for `apply.py mutants` (a heading naming it)",
        f"docs/commands.md:{line + 3}: 'python apply.py export tq-v0.33/0003 --repo "
        "~/src/vllm --onward origin/main --run-tests' does not parse: apply.py: "
        "error: unrecognized arguments: --onward origin/main",
    ]), new



RUN_BLOCK = """
```console docs-run
$ python apply.py rebase --abort       # exit 1: planted, it is 2
apply.py: error: no rebase in progress
$ python apply.py mutants tq/0999      # exit 2
apply.py: error: no such patch
$ python apply.py rebase --continue    # exit 2
apply.py: error: no rebase in progress
a line it does not print
$ python apply.py --base v1.0 \\
    --no-tests                         # exit 2
apply.py: error: --base v1.0: not a release (releases are vX.Y.Z, e.g. v0.33.0) \
nor a revision of a --repo
...
not compared
```
"""


def test_stale_documented_output(project: Path) -> None:
    """A docs-run command's exit code and first output lines are the tool's:
    a wrong `# exit N`, a stale first line, a line more than the tool
    prints are one line each, at the doc's line; a matching command
    (continued over two lines), a `...` and what follows it pass."""
    before = lines_of(run_check(project))
    doc = project / "docs" / "commands.md"
    n = len(doc.read_text().splitlines())
    with doc.open("a") as f:
        f.write(RUN_BLOCK)  # the fence is line n + 2
    out = planted(project, before)
    assert len(out) == 3, out
    assert out[0] == (
        f"docs/commands.md:{n + 3}: ran 'python apply.py rebase --abort': "
        "exit 2 (docs: 1)"
    )
    assert out[1].startswith(
        f"docs/commands.md:{n + 6}: ran 'python apply.py mutants tq/0999': "
        "first line 'apply.py: error: 'tq/0999': "
    ), out
    assert out[1].endswith(" (docs: 'apply.py: error: no such patch')"), out
    assert out[2] == (
        f"docs/commands.md:{n + 9}: ran 'python apply.py rebase --continue': "
        "no line 2, the output ends (docs: 'a line it does not print')"
    )


def test_real_documented_output_changed(project: Path) -> None:
    """The docs' own docs-run blocks run: a stale first line planted in
    commands.md's bad-input example, and a wrong exit code at its `check`
    example, are caught."""
    before = lines_of(run_check(project))
    doc = project / "docs" / "commands.md"
    lines = doc.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines)
              if ln.startswith("$ python apply.py --base v1.0 "))
    now = lines[at + 1]
    assert now.startswith("apply.py: error: --base v1.0: not a release"), now
    lines[at + 1] = "apply.py: error: --base v1.0: a stale message"
    chk = next(i for i, ln in enumerate(lines)
               if ln.split("#")[0].split() == ["$", "python", "apply.py", "check"])
    lines[chk] = "$ python apply.py check          # exit 1"
    doc.write_text("\n".join(lines) + "\n")
    out = planted(project, before)
    assert sorted(out) == sorted([
        (
            f"docs/commands.md:{at + 2}: ran 'python apply.py --base v1.0': "
            f"first line '{now}' (docs: 'apply.py: error: --base v1.0: a stale "
            "message')"
        ),
        f"docs/commands.md:{chk + 1}: ran 'python apply.py check': exit 0 (docs: 1)",
    ]), out
