"""The pytest plugin apply.py loads into every targeted-test run.

It runs inside the test Python (not in apply.py, which stays stdlib-only)
and does three things:

* selection: keeps only the node ids apply.py asked for
  (``VLLM_PATCHES_SELECT``). Passing node ids to pytest directly would stop
  the whole run at the first one that cannot be collected (an import error
  on a base, say); this way that module reports an error and every other
  test still runs;
* a time limit per test (``VLLM_PATCHES_TEST_TIMEOUT`` seconds), so one
  hung test is an ``error`` and the rest still run;
* verdicts: each test case gets a ``verdict`` property in the JUnit report,
  one of ``pass``, ``fail``, ``error`` or ``skip``, and a one-line
  ``reason``;
* where a failure is the expected outcome (``VLLM_PATCHES_EXPECT_FAIL``:
  node ids, or ``*`` for all: a regression test on the tree before its
  patch, a mutant's tests), a hypothesis test reports its first failing
  example unshrunk: the verdict needs the failure and its signature, not
  the smallest example (shrinking cost minutes per test); with
  ``VLLM_PATCHES_STOP_AT_KILL`` the run stops at the first test whose own
  check failed (a mutant is killed; the rest cannot change that).

A regression test declares what the bug looks like with one or more
``@pytest.mark.bug_signature(ExceptionType, r"message pattern")`` markers.
Such a test is ``fail`` (the bug is present) only when it fails with an
exception of that type whose message matches the pattern; any other
failure (an import error, API drift, a harness error, a crash with another
message, a timeout) is ``error``: it cannot tell. A test without a
signature is ``fail`` when an assertion fails (``AssertionError`` or
``pytest.fail``) and ``error`` for any other exception. A skip is
``skip``; the property ``skip=device`` marks a skip for a device the test
is not for (marker ``gpu`` without CUDA, marker ``cpu_only`` with CUDA),
``skip=tree`` one for a tree it is not for (marker ``some_trees``: it
compares what only some vLLM trees have). Neither is a missing verdict.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

SIGNATURE_MARKER = "bug_signature"


class TestTimeout(Exception):
    """A test ran past VLLM_PATCHES_TEST_TIMEOUT."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SIGNATURE_MARKER}(exc, pattern): the bug's signature; the test "
        "fails with it exactly when the bug is present",
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    raw = os.environ.get("VLLM_PATCHES_SELECT")
    if not raw:
        return
    want = raw.split("\n")
    gone = [i for i in items if not selected(i.nodeid, want)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if selected(i.nodeid, want)]


def selected(nid: str, want: list[str]) -> bool:
    """`nid` is one of the node ids in `want`, or a case of one."""
    return any(nid == w or nid.startswith((w + "::", w + "[")) for w in want)


def expect_fail(item: pytest.Item) -> bool:
    want = os.environ.get("VLLM_PATCHES_EXPECT_FAIL", "").split("\n")
    return want == ["*"] or selected(item.nodeid, want)


def without_shrinking(test: object) -> object | None:
    """`test`'s hypothesis settings without shrinking (and without the
    explain phase, which follows it), one failure reported; None for a
    test that is not a hypothesis test."""
    old = getattr(test, "_hypothesis_internal_use_settings", None)
    if old is None:
        return None
    from hypothesis import Phase, settings

    phases = [p for p in old.phases if p not in (Phase.shrink, Phase.explain)]
    return settings(old, phases=phases, report_multiple_bugs=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    test = getattr(item, "obj", None)
    fast = without_shrinking(test) if expect_fail(item) else None
    if fast is None:
        yield from timed_call()
        return
    old = test._hypothesis_internal_use_settings  # type: ignore[union-attr]
    test._hypothesis_internal_use_settings = fast  # type: ignore[union-attr]
    try:
        yield from timed_call()
    finally:
        test._hypothesis_internal_use_settings = old  # type: ignore[union-attr]


def timed_call():
    """The test call, under VLLM_PATCHES_TEST_TIMEOUT."""
    limit = float(os.environ.get("VLLM_PATCHES_TEST_TIMEOUT", "0") or 0)
    if limit <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TestTimeout(f"test timed out after {limit:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def signatures(item: pytest.Item) -> list[tuple[tuple[type, ...], str]]:
    out = []
    for m in item.iter_markers(SIGNATURE_MARKER):
        exc, pattern = m.args
        out.append((exc if isinstance(exc, tuple) else (exc,), pattern))
    return out


def classify_failure(item: pytest.Item, exc: BaseException) -> dict[str, str]:
    """The verdict of a test whose body raised `exc`. ``assertion`` says the
    test's own check failed (what kills a mutant), whatever the verdict."""
    reason = first_line(exc)
    if isinstance(exc, TestTimeout):
        return {"verdict": "error", "reason": reason}
    asserted = isinstance(exc, (AssertionError, pytest.fail.Exception))
    flag = {"assertion": "1"} if asserted else {}
    sigs = signatures(item)
    if sigs:
        for types, pattern in sigs:
            if isinstance(exc, types) and re.search(pattern, str(exc), re.S):
                return {"verdict": "fail", "reason": reason, "signature": pattern}
        why = f"not the bug's signature: {reason}"
        return {"verdict": "error", "reason": why, **flag}
    if asserted:
        return {"verdict": "fail", "reason": reason, **flag}
    return {"verdict": "error", "reason": reason}


def not_for_here(item: pytest.Item) -> str | None:
    """``"tree"`` or ``"device"`` where the test's skip is for a tree or a
    device it is not for (markers ``some_trees``, ``gpu``, ``cpu_only``),
    else None."""
    if item.get_closest_marker("some_trees"):
        return "tree"
    gpu, cpu = item.get_closest_marker("gpu"), item.get_closest_marker("cpu_only")
    if not gpu and not cpu:
        return None
    import torch

    cuda = torch.cuda.is_available()
    return "device" if (gpu and not cuda) or (cpu and cuda) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    # JUnit takes a test case's properties from its teardown report, which
    # copies item.user_properties: record the verdict there, once.
    props = dict(item.user_properties)
    if "verdict" in props and props["verdict"] != "pass":
        return
    got: dict[str, str] | None = None
    if rep.skipped:
        msg = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        got = {"verdict": "skip", "reason": msg.removeprefix("Skipped: ")[:300]}
        where = not_for_here(item)
        if where:
            got["skip"] = where
    elif rep.failed:
        exc = call.excinfo.value if call.excinfo else None
        if rep.when == "call" and exc is not None:
            got = classify_failure(item, exc)
        else:
            why = first_line(exc) if exc is not None else "failed"
            got = {"verdict": "error", "reason": f"{rep.when}: {why}"}
    elif rep.when == "call":
        got = {"verdict": "pass"}
    if got:
        item.user_properties[:] = [
            (k, v) for k, v in item.user_properties if k not in got
        ] + list(got.items())
        killed = got["verdict"] == "fail" or got.get("assertion") == "1"
        if killed and os.environ.get("VLLM_PATCHES_STOP_AT_KILL"):
            item.session.shouldstop = "a test's own check failed (mutant killed)"
