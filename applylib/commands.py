"""The check, test, base and format-patch commands."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .bases import (
    RELEASE_TAG,
    BaseUnavailable,
    assemble_base,
    cache_dir,
    find_user_repo,
    resolve_base,
)
from .core import (
    IDENTITY,
    UserError,
    format_patch,
    git,
    gout,
    open_repo,
    rev_commit,
    say,
)
from .mutants import lint_mutants
from .pinned import fetched_dir
from .series import (
    Patch,
    Series,
    Stack,
    check_agreement,
    lint_patch,
    load_patch,
    parse_series,
    pick_patch,
    stale_status,
)
from .testrun import aggregate, run_tests, test_python


def cmd_check(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    check_agreement(series)
    problems: list[str] = []
    checked = 0
    for st in series.stacks:
        loaded = []
        for entry in st.patches:
            p = load_patch(series, entry)
            problems += lint_patch(series, p)
            loaded.append(p)
            checked += 1
        problems += roundtrip(
            series, st, loaded, find_user_repo(args.repo), fetched_dir(args)
        )
    problems += lint_mutants(series)
    for note in stale_status(series):
        print(note)
    for pr in problems:
        print(pr)
    if problems:
        say(f"apply.py check: {len(problems)} problem(s)")
        return 1
    print(f"apply.py check: {checked} patches in {len(series.stacks)} stacks: ok")
    return 0


def roundtrip_base(
    stack: Stack, user_repo: Path | None, fetched: Path | None
) -> tuple[Path, str] | None:
    """The stack's base when at hand, without fetching or downloading: in
    the user's repository or the tool's cache, else assembled from the
    pinned files in `fetched` when its release is at hand."""
    for repo in (user_repo, cache_dir() / "vllm.git"):
        if repo is None or not (
            repo.is_dir() and (repo / "HEAD").exists() or (repo / ".git").exists()
        ):
            continue
        for r in (
            stack.pins.get("commit"),
            stack.pins.get("tag"),
            stack.pins.get("branch"),
        ):
            base = rev_commit(repo, r) if r else None
            if base:
                return repo, base
    release = stack.pins.get("assemble")
    if fetched is None or not release:
        return None
    version = RELEASE_TAG.match(release).group(1)
    cache = cache_dir() / "vllm.git"
    if not list((cache_dir() / "dist").glob(f"vllm-{version}-*.whl")) and not (
        cache.is_dir() and rev_commit(cache, f"refs/tags/{release}")
    ):
        return None
    base = assemble_base(stack, fetched)
    return base.repo, base.commit


def roundtrip(
    series: Series,
    stack: Stack,
    patches: list[Patch],
    user_repo: Path | None,
    fetched: Path | None = None,
) -> list[str]:
    """Re-export each patch from its base (when at hand) and compare bytes.

    Offline and without a checkout: the patches are applied to the base's
    tree in a temporary index, committed with their own author, date and
    message, and exported again.
    """
    found = roundtrip_base(stack, user_repo, fetched)
    if found is None:
        get = f"run 'apply.py base --stack {stack.name}' first"
        if stack.pins.get("assemble"):
            get = (
                "give --fetched DIR, the pinned files it is assembled from"
                if fetched is None
                else f"run 'apply.py base --stack {stack.name} --fetched {fetched}'"
            )
        print(
            f"note: stack {stack.name}: base not at hand, export round-trip "
            f"not checked ({get})"
        )
        return []
    repo, base = found
    probs = reexport_stack(repo, base, patches)
    if not probs:
        print(f"stack {stack.name}: export round-trip on {base[:12]}: byte-identical")
    return probs


def reexport_stack(repo: Path, base: str, patches: list[Patch]) -> list[str]:
    """Each patch committed in order on `base` and exported again: the
    patches whose export differs (or that do not apply)."""
    probs = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", base, cwd=repo, env=env)
        parent = base
        for p in patches:
            commit = recommit(repo, Path(tmp), env, parent, p)
            if commit is None:
                probs.append(
                    f"patches/{p.file}: does not apply to the stack's base in order"
                )
                break
            again = format_patch(repo, commit)
            if again != p.raw:
                probs.append(
                    f"patches/{p.file}: re-export differs (not a "
                    "deterministic export; use 'apply.py format-patch')"
                )
            parent = commit
    return probs


def recommit(
    repo: Path, tmp: Path, env: dict[str, str], parent: str, p: Patch
) -> str | None:
    """The patch applied to the temporary index and committed on `parent`
    with its own author, date and message; None where it does not apply."""
    info = git(
        "mailinfo",
        "-k",
        "-b",
        str(tmp / "msg"),
        str(tmp / "diff"),
        cwd=repo,
        input=p.raw,
    ).stdout
    hdr = dict(ln.split(": ", 1) for ln in info.decode().splitlines() if ": " in ln)
    msg = hdr.get("Subject", "") + "\n\n" + (tmp / "msg").read_text()
    proc = git(
        "apply",
        "--cached",
        str(tmp / "diff"),
        cwd=repo,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        return None
    tree = gout("write-tree", cwd=repo, env=env)
    cenv = dict(
        env,
        GIT_AUTHOR_NAME=hdr.get("Author", ""),
        GIT_AUTHOR_EMAIL=hdr.get("Email", ""),
        GIT_AUTHOR_DATE=hdr.get("Date", ""),
        GIT_COMMITTER_NAME=IDENTITY[0],
        GIT_COMMITTER_EMAIL=IDENTITY[1],
        GIT_COMMITTER_DATE=hdr.get("Date", ""),
    )
    return gout(
        "commit-tree",
        tree,
        "-p",
        parent,
        cwd=repo,
        env=cenv,
        input=msg.rstrip("\n").encode() + b"\n",
    )


def cmd_test(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series))
    tree = Path(args.tree).expanduser().resolve()
    if not (tree / "vllm" / "__init__.py").is_file():
        raise UserError(f"{tree}: not a vLLM tree (no vllm/__init__.py)")
    wanted = args.patches or [p for s in series.stacks for p in s.patches]
    chosen = [load_patch(series, pick_patch(series, w)[1]) for w in wanted]
    ids: list[str] = []
    for p in chosen:
        ids += [t for t in p.tests if t not in ids]
    out, log = run_tests(series.root, tree, ids, test_python(args.python), "tree")
    print(log.rstrip()[-4000:])
    rows = []
    code = 0
    for p in chosen:
        r = aggregate([out[t] for t in p.tests])
        rows.append(
            {
                "file": p.file,
                "tests": r.verdict,
                "outcomes": {t: out[t].to_json() for t in p.tests},
            }
        )
        why = f" ({r.reason})" if r.reason and r.verdict != "pass" else ""
        print(f"  {p.file}: {r.verdict}{why}")
        if r.verdict in ("fail", "error"):
            code = 1
    if args.json:
        Path(args.json).write_text(
            json.dumps({"tree": str(tree), "patches": rows}, indent=2) + "\n"
        )
    return code


def cmd_base(args: argparse.Namespace) -> int:
    series = parse_series(Path(args.series), need_patches=False)
    stack = series.stack(args.stack)
    user_repo = find_user_repo(args.repo)
    fetched = fetched_dir(args)
    if args.rev and args.base and args.rev != args.base:
        raise UserError(
            f"two bases: --base {args.base} and {args.rev}: give one "
            "(apply.py base REV)"
        )
    try:
        base = resolve_base(
            stack, args.rev or args.base, user_repo, args.offline, fetched, args.python
        )
    except BaseUnavailable as e:
        say(f"apply.py: base unavailable: {e.reason}\n  to get it: {e.hint}")
        return 1
    up = f" upstream={base.upstream_commit}" if base.upstream_commit else ""
    if base.fetched:
        up += f" fetched={base.fetched}"
    print(f"{base.rev} {base.commit} repo={base.repo} source={base.source}{up}")
    return 0


def cmd_format_patch(args: argparse.Namespace) -> int:
    repo = open_repo(Path(args.repo))
    if not rev_commit(repo, args.rev):
        raise UserError(f"unknown revision '{args.rev}' in {repo}")
    data = format_patch(repo, args.rev)
    if args.out:
        Path(args.out).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
    return 0
