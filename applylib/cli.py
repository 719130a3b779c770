"""The command line: one parser, every command."""

from __future__ import annotations

import argparse
import errno
import os
import signal
from pathlib import Path

from .commands import cmd_base, cmd_check, cmd_format_patch, cmd_test
from .core import (
    PROJECT,
    GitError,
    UserError,
    command,
    common,
    patch_names,
    say,
    writable_output,
)
from .export import add_deliver_commands
from .image import add_image_command
from .mutants import add_mutants_command
from .rebase import add_rebase_command
from .runner import cmd_apply
from .status import add_status_command
from .upstreamsuite import add_upstream_command

FMT = argparse.RawDescriptionHelpFormatter


def parser() -> argparse.ArgumentParser:
    """The whole command line: the global options, then every command."""
    p = argparse.ArgumentParser(
        prog="apply.py",
        formatter_class=FMT,
        description="Apply the vLLM patch series onto a base, run each patch's "
        "targeted tests, and report.",
        epilog="examples:\n"
        "  python apply.py                      # every stack at its pin\n"
        "  python apply.py --base v0.20.2 --repo ~/src/vllm --json out.json\n"
        "commands: check, test, base, format-patch, rebase, status, wheel,\n"
        "          image, export, mutants, upstream (each has --help with an "
        "example)\n"
        "exit: 0 ok, 1 conflict or test failure, 2 bad input",
    )
    add_global_options(p)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    add_check_command(sub)
    add_test_command(sub)
    add_base_command(sub)
    add_format_patch_command(sub)
    add_rebase_command(sub)
    add_status_command(sub)
    add_deliver_commands(sub)
    add_image_command(sub)
    add_mutants_command(sub)
    add_upstream_command(sub)
    for sp in sub.choices.values():
        common(sp, "series")
    return p


def add_global_options(p: argparse.ArgumentParser) -> None:
    """The options of the default command (apply), given before a command."""
    p.add_argument(
        "--series",
        default=str(PROJECT / "series"),
        help="series file (default: ./series beside apply.py)",
    )
    p.add_argument("--base", help="base revision (default: each stack's pin)")
    p.add_argument(
        "--repo",
        help="vLLM git repository (default: $VLLM_REPO, "
        "./vllm, else the tool's cache filled from a remote or PyPI)",
    )
    p.add_argument(
        "--stack",
        help="stack to apply (default: all; with --base, the stack pinned to "
        "that release, else to the newest release before it)",
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument(
        "--require-all",
        action="store_true",
        help="a stack skipped for want of its base is an error",
    )
    p.add_argument("--no-tests", action="store_true", help="apply only")
    p.add_argument(
        "--fetched",
        metavar="DIR",
        help="pinned files for bases that cannot be fetched: a stack with "
        "assemble=vX.Y.Z gets that release with its patches' files as they are "
        "at their pins, from DIR/<owner>-<name>-<commit>/<path> "
        "(default $VLLM_PATCHES_FETCHED)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=bool(os.environ.get("VLLM_PATCHES_OFFLINE")),
        help="never try git remotes (also $VLLM_PATCHES_OFFLINE=1)",
    )
    p.add_argument(
        "--python",
        help="Python that runs the targeted tests "
        "(default: $VLLM_PATCHES_PYTHON, the project's .venv, this one)",
    )


def add_check_command(sub: argparse._SubParsersAction) -> None:
    """apply.py check: lint the series."""
    c = command(
        sub,
        "check",
        cmd_check,
        help="lint the series and patches (fast, offline)",
        description="Check that series and patches/ agree, every "
        "patch parses with the required trailers, touches only "
        "safe paths, and re-exports byte-identically.",
        epilog="example:\n  python apply.py check",
    )
    common(c, "repo", "fetched")


def add_test_command(sub: argparse._SubParsersAction) -> None:
    """apply.py test: the targeted tests against a tree."""
    t = command(
        sub,
        "test",
        cmd_test,
        help="run patches' targeted tests against a tree",
        description="Run the targeted tests (Tests: trailers) of "
        "the given patches (default: all) against a vLLM tree.",
        epilog="example:\n  python apply.py test tq/0002 --tree ~/src/vllm",
    )
    patch_names(t)
    t.add_argument("--tree", required=True, help="vLLM source tree root")
    t.add_argument("--json", help="write results here")
    common(t, "python", "offline")


def add_base_command(sub: argparse._SubParsersAction) -> None:
    """apply.py base: obtain a base and print it."""
    b = command(
        sub,
        "base",
        cmd_base,
        help="obtain a base (remote or PyPI release) and print it",
        description="Resolve a stack's base, obtaining it into "
        "the tool's cache repository if needed.",
        epilog="example:\n  python apply.py base v0.21.0",
    )
    b.add_argument("rev", nargs="?", help="revision (default: the stack's pin)")
    common(b, "python", "offline", "stack", "repo", "fetched")


def add_format_patch_command(sub: argparse._SubParsersAction) -> None:
    """apply.py format-patch: the deterministic export of one commit."""
    f = command(
        sub,
        "format-patch",
        cmd_format_patch,
        help="export one commit deterministically",
        description="Export one commit as a patch file with the "
        "series' pinned format-patch flags.",
        epilog="example:\n  python apply.py format-patch --repo "
        "../vllm HEAD --out patches/tq/0004-x.patch",
    )
    f.add_argument("rev", nargs="?", default="HEAD")
    f.add_argument("--repo", required=True)
    f.add_argument("--out")


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, as Ctrl-C's KeyboardInterrupt."""


def terminated(signum: int, frame: object) -> None:
    raise Terminated


def interrupted(code: int) -> int:
    """Ctrl-C or SIGTERM: every test run it started ends, one line, 130/143."""
    from . import warm

    warm.stop_all()
    say("apply.py: interrupted; the next run clears what this one left in its cache")
    return code


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, terminated)
    try:
        if getattr(args, "json", None):  # before the work, not after it
            writable_output(Path(args.json), "--json")
        if getattr(args, "func", None):
            return args.func(args)
        return cmd_apply(args)
    except UserError as e:
        say(f"apply.py: error: {e}")
        return 2
    except GitError as e:
        say(f"apply.py: error: {e}")
        return 2
    except OSError as e:  # the environment, not the input: one line, exit 2
        where = f" ({e.filename})" if e.filename else ""
        disk = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
        fix = "free space or fix the disk" if disk else "fix it and run again"
        say(f"apply.py: error: {e.strerror or e}{where}: {fix}")
        return 2
    except KeyboardInterrupt:
        return interrupted(130)
    except Terminated:
        return interrupted(143)
