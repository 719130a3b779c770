"""Which stack a --base means: the release the base stands on (a tag, a
commit of a clone, a wheel file, an installed vLLM), then the stack pinned
there or, between two pins, the neighbouring stack that applies."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from .bases import RELEASE_TAG, built_version, describe_base, rev_forms
from .core import UserError, rev_commit, say
from .probe import VERSION
from .series import Series, Stack, release_key, short_name

# a version short of vX.Y.Z (v0.33): a typo, unless a clone has it as a ref
NOT_A_RELEASE = re.compile(r"^v?\d+\.\d+$")

# a stack's patches applied on the base without tests: the files of those
# that do not apply there, each with the file it changes that the base lacks
# ("" if none), or None where the base cannot be had
DryApply = Callable[[Stack], "dict[str, str] | None"]


def stack_pin(stack: Stack) -> str:
    p = stack.pins
    return f"pinned to {p.get('tag') or p.get('branch') or p.get('commit', '?')}"


def stacks_for_base(
    series: Series, args: argparse.Namespace, user_repo: Path | None, dry: DryApply
) -> list[Stack]:
    """--stack NAME; no --base: every stack; else the stack of the release
    the base stands on, said in one line: the one pinned there, or the
    newest pinned before it, or, between two pins, the one a dry apply
    chooses. A base that is no release and stands on none: exit 2."""
    if (
        args.base
        and NOT_A_RELEASE.match(args.base)
        and (user_repo is None or not rev_commit(user_repo, args.base))
    ):
        raise UserError(
            f"--base {args.base}: not a release (releases are vX.Y.Z, "
            "e.g. v0.33.0) nor a revision of a --repo"
        )
    built = args.base == "installed" or str(args.base).endswith(".whl")
    in_clone = args.base and user_repo is not None and not built
    if in_clone and not any(rev_commit(user_repo, r) for r in rev_forms(args.base)):
        raise UserError(f"unknown revision '{args.base}' in {user_repo}")
    if args.stack:
        return [series.stack(args.stack)]
    if not args.base or len(series.stacks) == 1:
        return series.stacks
    m = RELEASE_TAG.match(args.base)  # v0.33.0, 0.33.0, v0.33.0.post1
    release = "v" + m.group(1).split(".post")[0] if m else base_release(args, user_repo)
    around = series.pins_around(release)
    if around:
        return [between_pins(around, release, dry)]
    stack = series.pick_stack(None, release)
    pins = series.released()
    before = release_key(release) and pins and release_key(release) < pins[0][0]
    say(
        f"apply.py: --base {args.base} without --stack: using stack "
        f"'{stack.name}' ({stack_pin(stack)})"
        + (f": {release} is older than every stack's pin" if before else "")
    )
    return [stack]


def base_release(args: argparse.Namespace, user_repo: Path | None) -> str:
    """The release a --base that is no release stands on, said in one
    line; offline, a release's upstream commit that the cache holds
    becomes that release. Unknown: exit 2, never the first stack by
    default. A built vLLM (a wheel file, an installed vLLM) stands on the
    release its version names."""
    built = built_version(args.base, args.python)
    if built is not None:
        return built_release(args.base, *built)
    known = describe_base(args.base, user_repo)
    if known is None:
        where = f"in {user_repo}" if user_repo else "(no --repo; the cache knows "
        where += "" if user_repo else "only the releases' upstream commits)"
        raise UserError(
            f"--base {args.base}: no release below it {where}: "
            "give --repo a clone that has it, or name the stack with --stack"
        )
    tag, line = known
    say(f"apply.py: {line}")
    if user_repo is None:
        args.base = tag
    return tag


def built_release(rev: str, label: str, version: str) -> str:
    """The release of a built vLLM's version (0.33.0, 0.33.0+local,
    0.33.0.post1: v0.33.0); a build between releases (0.33.1.dev12+g...,
    an rc): exit 2."""
    m = VERSION.match(version)
    if m is None:
        raise UserError(
            f"--base {rev}: vllm {version} is a build between releases: "
            "name the stack with --stack"
        )
    tag = "v" + m.group(1).split(".post")[0]
    say(f"apply.py: base {label} = vllm {version}: a build of {tag}")
    return tag


def between_pins(around: tuple[Stack, Stack], release: str, dry: DryApply) -> Stack:
    """A release between two stacks' pins has no stack made for it: each
    neighbour is applied there (the 3-way fallback, no tests), the older
    pin's first; the first that applies whole runs, else the one where the
    most patches apply (the older on a tie), and each tried stack's
    patches that need a port are named."""
    old, new = around
    say(
        f"apply.py: no stack is pinned to {release}: it lies between "
        f"'{old.name}' ({stack_pin(old)}) and '{new.name}' ({stack_pin(new)}); "
        "applying each there to choose (docs/releases.md)"
    )
    tried: list[tuple[Stack, int]] = []
    for stack in around:
        failed = dry(stack)
        if failed is None:
            say(f"apply.py:   '{stack.name}': its base is unavailable")
            continue
        port = [short_name(f) for f, gone in failed.items() if not gone]
        n, of = len(stack.patches) - len(failed), len(stack.patches)
        need = f"; {', '.join(port)} need a port" if port else ""
        for gone in sorted(set(failed.values()) - {""}):
            which = [short_name(f) for f, g in failed.items() if g == gone]
            need += f"; {', '.join(which)} not applicable (no {gone} there)"
        say(f"apply.py:   '{stack.name}': {n} of {of} patches apply{need}")
        if not port:
            whole = "applies whole" if not failed else "applies where it can"
            say(f"apply.py: using stack '{stack.name}', which {whole}")
            return stack
        tried.append((stack, n))
    if not tried:
        return old
    best = max(tried, key=lambda t: t[1])[0]  # the first of equals: the older
    say(
        f"apply.py: no stack applies whole on {release}: using '{best.name}', "
        "where the most patches apply; the rest need a port "
        f"(or --stack {(new if best is old else old).name})"
    )
    return best
