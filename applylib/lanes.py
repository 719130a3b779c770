"""Pytest runs side by side: one lane per core (``$VLLM_PATCHES_JOBS``).

A targeted-test run is one Python process, mostly on one core (Triton's
interpreter, numpy), so the runs of the stacks' positions and of a stack's
mutants go in lanes: each lane owns two of the tool's worktrees per stack
(a ``TreeRing``: the tree a run tests and the one before it), and git moves
a lane's trees only from that lane's thread, so no two runs share a tree
that moves; the lanes make and move worktrees one at a time (git's worktree
admin files are shared by the repository).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from .bases import worktree
from .core import UserError

T = TypeVar("T")
R = TypeVar("R")
GIT_WORKTREES = threading.Lock()


def lanes() -> int:
    """How many pytest runs at once: $VLLM_PATCHES_JOBS, else one per core
    this process may use, at most 4 (each run holds 1-2 GB)."""
    raw = os.environ.get("VLLM_PATCHES_JOBS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"VLLM_PATCHES_JOBS={raw}: not a positive integer")
        return int(raw)
    return max(1, min(4, len(os.sched_getaffinity(0))))


def in_lanes(items: Sequence[T], work: Callable[[int, T], R], n: int) -> list[R]:
    """`work(lane, item)` for every item, in `n` threads that each take the
    next item when done; the results in the items' order. An exception in
    a lane stops the others after their current item and is raised here."""
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(items)):
        todo.put(i)
    out: dict[int, R] = {}
    failed: list[Exception] = []

    def lane(k: int) -> None:
        while not failed:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = work(k, items[i])
            except Exception as e:  # noqa: BLE001 (re-raised in the caller's thread)
                failed.append(e)

    threads = [
        threading.Thread(target=lane, args=(k,), daemon=True)
        for k in range(max(1, min(n, len(items))))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return [out[i] for i in range(len(items))]


class TreeRing:
    """Two of the tool's worktrees (`key`-`2*lane`, `key`-`2*lane+1`) moved
    from commit to commit as runs need them, and `top`, already at
    `top_commit` (read, never moved)."""

    def __init__(
        self,
        repo: Path,
        key: str,
        top: Path | None,
        top_commit: str | None,
        lane: int = 0,
    ):
        self.repo, self.key, self.lane = repo, key, lane
        self.top, self.top_commit = top, top_commit
        self.slots: list[tuple[str, Path] | None] = [None, None]

    def at(self, commit: str, keep: str | None, mutable: bool = False) -> Path:
        """A worktree at `commit`, never moving the one at `keep`; `mutable`:
        one of the lane's own (a run may change it), never `top`."""
        if not mutable and self.top is not None and commit == self.top_commit:
            return self.top
        for slot in self.slots:
            if slot is not None and slot[0] == commit:
                return slot[1]
        s = 1 if self.slots[0] is not None and self.slots[0][0] == keep else 0
        with GIT_WORKTREES:  # `git worktree add`/`prune` race in one repo
            path = worktree(self.repo, f"{self.key}-{2 * self.lane + s}", commit)
        self.slots[s] = (commit, path)
        return path
