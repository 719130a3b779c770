"""status --culprit: per patch, where in an ordered list of bases (releases,
or the commits of a vLLM clone) it stops applying, and where its bug is
absorbed upstream, each found by bisection rather than by trying every
base.

Bisection assumes one change per question and range (like git bisect): a
patch applies up to some base and not from it on; its regression tests fail
(the bug is there) up to some base and pass from it on. A base where the
question cannot be answered (the base unavailable; the tests error: API
drift, an import error, a timeout) is skipped like `git bisect skip`, and a
neighbour is probed instead. Each probe is printed as it is made.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .core import gout
from .runner import APPLIED, positions, ran, run_positions, table, try_apply
from .series import Patch, Series, Stack, load_patch, short_name
from .testrun import Outcome, aggregate, test_python


def around(mid: int, lo: int, hi: int) -> Iterator[int]:
    """The bases to try for one bisection step in (lo, hi): mid; where it
    cannot tell, halving toward lo, then toward hi (a block of bases that
    cannot tell at one end, e.g. test drift that grows with distance from
    the patch's base, is crossed in log steps); then every other base
    between, nearest first."""
    order = [mid]
    a = mid
    while a - lo > 1:
        a = (lo + a) // 2
        order.append(a)
    b = mid
    while hi - b > 1:
        b = (b + hi + 1) // 2
        order.append(b)
    for d in range(1, hi - lo):
        order += [mid - d, mid + d]
    yield from dict.fromkeys(i for i in order if lo < i < hi)


def first_change(
    n: int, probe: Callable[[int], bool | None], max_skips: int | None = None
) -> dict:
    """Bisect the indices 0..n-1 for the first one where the state has
    changed. probe(i): True (as at the start), False (changed), None
    (cannot tell: skipped, and other bases tried). -1 stands for 'before
    the range' (as at the start) and n for 'after it' (changed), so no end
    is probed unless the bisection gets there. After `max_skips` probes
    that cannot tell, it stops where it is.

    Returns last_same (-1: changed already at the start of the range),
    first_changed (n: not within the range), cannot_tell (the skipped
    indices between them), not_probed (the others between them) and probed
    (every index probed, in order)."""
    lo, hi = -1, n
    known: dict[int, bool | None] = {}

    def decide() -> int | None:
        for i in around((lo + hi) // 2, lo, hi):
            if i not in known:
                skips = sum(v is None for v in known.values())
                if max_skips is not None and 0 <= max_skips <= skips:
                    return None
                known[i] = probe(i)
            if known[i] is not None:
                return i
        return None

    while hi - lo > 1:
        i = decide()
        if i is None:
            break  # every base between lo and hi cannot tell, or no more skips
        if known[i]:
            lo = i
        else:
            hi = i
    between = range(lo + 1, hi)
    return {
        "last_same": lo,
        "first_changed": hi,
        "cannot_tell": [i for i in between if i in known],
        "not_probed": [i for i in between if i not in known],
        "probed": list(known),
    }


def label(rev: str) -> str:
    return rev[:12] if re.fullmatch(r"[0-9a-f]{40}", rev) else rev


class Prober:
    """Applies the stack on a base (once per base) and runs one patch's
    regression tests at its position there (once per base and patch)."""

    def __init__(
        self,
        series: Series,
        stack: Stack,
        user_repo: Path | None,
        args: argparse.Namespace,
    ):
        self.series, self.stack, self.user_repo, self.args = (
            series,
            stack,
            user_repo,
            args,
        )
        self.patches = [load_patch(series, p) for p in stack.patches]
        self.applied: dict[str, tuple] = {}
        self.verdicts: dict[tuple[str, str], Outcome] = {}
        self.python = test_python(args.python)

    def apply_at(self, rev: str) -> tuple:
        if rev not in self.applied:
            got = try_apply(
                self.series, self.stack, rev, self.user_repo, self.args, "culprit"
            )
            self.applied[rev] = got
            base, res, why = got
            what = (
                f"base unavailable ({why})"
                if base is None
                else ", ".join(f"{short_name(f)} {r.apply}" for f, r in res.items())
            )
            print(f"    probe {label(rev)}: apply: {what}", flush=True)
        return self.applied[rev]

    def applies(self, rev: str, p: Patch) -> bool | None:
        base, res, _ = self.apply_at(rev)
        return None if base is None else res[p.file].apply in APPLIED

    def verdict(self, rev: str, p: Patch) -> Outcome:
        key = (rev, p.file)
        if key not in self.verdicts:
            base, res, why = self.apply_at(rev)
            if base is None:
                o = Outcome("error", f"base unavailable: {why}")
            else:
                i = self.patches.index(p)
                commits = positions(base.commit, self.patches, res)
                outs, _ = run_positions(
                    self.series,
                    base.repo,
                    f"{self.stack.name}-culprit-at",
                    commits,
                    {i: p.regression},
                    self.python,
                )
                o = ran(aggregate([outs[i][t] for t in p.regression]))
            self.verdicts[key] = o
            why = f" ({o.reason})" if o.reason and o.verdict != "pass" else ""
            print(
                f"    probe {label(rev)}: {short_name(p.file)} regression: {o.verdict}{why}",
                flush=True,
            )
        return self.verdicts[key]

    def bug_present(self, rev: str, p: Patch) -> bool | None:
        return {"fail": True, "pass": False}.get(self.verdict(rev, p).verdict)


def answer(revs: list[str], found: dict, repo: Path | None) -> dict:
    """A bisection's result as revisions; with `repo` (commits of a clone)
    the culprit commit's subject too."""
    lo, hi, n = found["last_same"], found["first_changed"], len(revs)
    if lo == -1 and hi == n:
        kind = "unknown"
    elif hi == n:
        kind = "never" if lo == n - 1 else "unknown-after"
    elif lo == -1 and hi == 0:
        kind = "at-start"
    else:
        kind = "found" if hi == lo + 1 else "between"
    out = {
        "answer": kind,
        "first": revs[hi] if hi < n else None,
        "last_before": revs[lo] if lo >= 0 else None,
        "cannot_tell": [revs[i] for i in found["cannot_tell"]],
        "not_probed": [revs[i] for i in found["not_probed"]],
        "probed": [revs[i] for i in found["probed"]],
    }
    if kind == "between":
        out["from"] = revs[lo + 1]
    if kind == "found" and repo is not None:
        subject = gout("log", "-1", "--format=%s", revs[hi], cwd=repo)
        out["commit"] = {"id": revs[hi], "subject": subject}
    return out


QUESTIONS = {
    "stops_applying": ("stops applying", "applies", "does not apply"),
    "absorbed": ("bug absorbed", "regression tests fail", "they pass"),
}


def words(x: dict, key: str) -> str:
    """One answer in words: the cell of the table."""
    _, same, _ = QUESTIONS[key]
    first, last = label(x["first"] or ""), label(x["last_before"] or "")
    return {
        "unknown": "cannot tell in the range",
        "never": f"not in the range ({same} at {last})",
        "unknown-after": f"not up to {last}; cannot tell after it",
        "at-start": f"at or before {first} (the range's start)",
        "found": first,
        "between": f"in {label(x.get('from') or '')}..{first}",
    }[x["answer"]]


def cmd_culprit(
    series: Series,
    stack: Stack,
    revs: list[str],
    user_repo: Path | None,
    args: argparse.Namespace,
) -> int:
    """For each patch: bisect where it stops applying, then where its bug
    is absorbed (its regression verdict turns from fail to pass); print
    the probes as they are made, then the answers."""
    prober = Prober(series, stack, user_repo, args)
    repo = user_repo if args.commits else None
    kind = "commits" if args.commits else "bases"
    print(
        f"culprit search: stack {stack.name} over {label(revs[0])}.."
        f"{label(revs[-1])} ({len(revs)} {kind})",
        flush=True,
    )
    results = []
    for p in prober.patches:
        print(f"  {short_name(p.file)}: where it stops applying", flush=True)
        found = first_change(
            len(revs), lambda i, p=p: prober.applies(revs[i], p), args.max_skips
        )
        stops = answer(revs, found, repo)
        print(f"  {short_name(p.file)}: where its bug is absorbed", flush=True)
        found = first_change(
            len(revs), lambda i, p=p: prober.bug_present(revs[i], p), args.max_skips
        )
        absorbed = answer(revs, found, repo)
        results.append({"file": p.file, "stops_applying": stops, "absorbed": absorbed})
    print_culprits(results, len(revs), prober)
    if getattr(args, "json", None):
        report = {
            "stack": stack.name,
            "date": time.strftime("%Y-%m-%d"),
            "bases": revs,
            "patches": results,
            "probes": {
                "apply": list(prober.applied),
                "regression": [
                    {"base": r, "file": f, **o.to_json()}
                    for (r, f), o in prober.verdicts.items()
                ],
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.json}")
    return 0


def print_culprits(results: list[dict], n: int, prober: Prober) -> None:
    """The answers: a table, then one line per finding and per base that
    could not tell (with why)."""
    print()
    rows = [("patch", "stops applying", "bug absorbed", "probes")]
    for r in results:
        s, a = r["stops_applying"], r["absorbed"]
        probes = f"{len(s['probed'])} + {len(a['probed'])} of {n}"
        rows.append(
            (
                short_name(r["file"]),
                words(s, "stops_applying"),
                words(a, "absorbed"),
                probes,
            )
        )
    for line in table(rows):
        print(line)
    for r in results:
        for key, (verb, same, _) in QUESTIONS.items():
            x, name = r[key], short_name(r["file"])
            if x.get("commit"):
                c = x["commit"]
                print(f"  {name}: {verb} at {c['id']} {c['subject']}")
            elif x["answer"] == "found" and x["last_before"]:
                print(
                    f"  {name}: {verb} at {label(x['first'])} ({same} at "
                    f"{label(x['last_before'])})"
                )
            for rev in x["cannot_tell"]:
                o = prober.verdicts.get((rev, r["file"]))
                why = o.reason if key == "absorbed" and o is not None else ""
                why = why or (prober.applied.get(rev) or (None, None, ""))[2]
                print(f"  {name}: {verb}: cannot tell at {label(rev)}: {why}")
            if x["not_probed"]:
                print(
                    f"  {name}: {verb}: not probed (--max-skips reached): "
                    + ", ".join(map(label, x["not_probed"]))
                )
    print(
        "probes: bases tried for 'stops applying' + for 'bug absorbed', of all in "
        "the range"
    )
