"""A..B ranges of bases: the vLLM releases the package index and the
repositories know, and the first-parent commits of a clone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .bases import RELEASE_TAG, cache_dir
from .core import UserError, gout, rev_commit


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def known_releases(user_repo: Path | None, offline: bool) -> tuple[set[str], bool]:
    """Final releases X.Y.Z that the package index lists (unless offline)
    and that the repos tag; and whether the index answered."""
    found: set[str] = set()
    answered = False
    if not offline:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "vllm"]
            + ["--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=False,
        )
        m = re.search(r"Available versions: (.*)", proc.stdout)
        if m:
            answered = True
            found |= {v.strip() for v in m.group(1).split(",")}
    for repo in (user_repo, cache_dir() / "vllm.git"):
        if repo is not None and repo.exists():
            found |= {
                t[1:]
                for t in gout("tag", "--list", "v*", cwd=repo, check=False).split()
            }
    return {v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v)}, answered


def list_releases(lo: str, hi: str, user_repo: Path | None, offline: bool) -> list[str]:
    """Final releases lo..hi (inclusive), oldest first, as vX.Y.Z."""
    found, _ = known_releases(user_repo, offline)
    want = [v for v in found if version_key(lo) <= version_key(v) <= version_key(hi)]
    if not want:
        raise UserError(
            f"no vLLM release between {lo} and {hi} (pip index "
            "unreachable and none cached?)"
        )
    return [f"v{v}" for v in sorted(want, key=version_key)]


def parse_range(text: str, user_repo: Path | None, offline: bool) -> list[str]:
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise UserError(f"range '{text}' is not A..B")
    if RELEASE_TAG.match(lo) and RELEASE_TAG.match(hi):
        return list_releases(lo.lstrip("v"), hi.lstrip("v"), user_repo, offline)
    if user_repo is None:
        raise UserError(
            "a commit range needs --repo (release ranges vA..vB work without one)"
        )
    commits = gout(
        "rev-list",
        "--first-parent",
        "--reverse",
        f"{lo}..{hi}",
        cwd=user_repo,
        check=False,
    ).split()
    if not commits:
        raise UserError(f"empty or unknown range '{text}' in {user_repo}")
    return commits


def commit_range(text: str, user_repo: Path | None) -> list[str]:
    """A..B in --repo: A, then the first-parent commits after it up to B."""
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise UserError(f"range '{text}' is not A..B")
    if user_repo is None:
        raise UserError("--commits needs --repo (a vLLM git clone)")
    start = rev_commit(user_repo, lo)
    if start is None or rev_commit(user_repo, hi) is None:
        raise UserError(f"unknown revision in '{text}' in {user_repo}")
    return [start] + parse_range(f"{start}..{hi}", user_repo, True)
