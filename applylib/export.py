"""apply.py export: one upstream PR branch per patch (its texts are in
prtext); registers the delivery commands (wheel, export)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from .bases import (
    Base,
    BaseUnavailable,
    cache_dir,
    find_user_repo,
    locked,
    repo_lock,
    resolve_base,
    worktree,
)
from .core import (
    IDENTITY,
    REF_NS,
    UserError,
    command,
    common,
    format_patch,
    git,
    gout,
    rev_commit,
    say,
)
from .pinned import fetched_dir
from .prtext import adapt_test_module, helper_paths, pr_message, series_words
from .runner import PatchResult, apply_stack
from .series import (
    DIFF_GIT,
    Patch,
    Series,
    Stack,
    check_safe_relpath,
    load_patch,
    parse_series,
    pick_patch,
)
from .testrun import test_python
from .upstreamsuite import (
    diff_files,
    upstream_diff,
    upstream_test_dir,
    upstream_tests,
)
from .upstreamtest import Proof, before_and_with, fail_without_fix
from .wheelbuild import add_wheel_options, cmd_wheel

# Subject component -> vLLM's test directory for it.
COMPONENT_TESTS = {
    "attention": "tests/v1/attention",
    "turboquant": "tests/v1/attention",
    "kernel": "tests/kernels",
    "quantization": "tests/quantization",
}


def vllm_test_dir(repo: Path, rev: str, patch: Patch) -> str:
    """Where vLLM keeps the tests of what a patch changes.

    By the subject's component ([Attention][TurboQuant] ...) where vLLM has
    a test directory for it; else by the code the patch changes most: vLLM
    mirrors its package in tests/ (vllm/model_executor/... is tested in
    tests/model_executor/), the deepest such directory the base has, else
    the first two levels (a release base made from a wheel has no tests/).
    """
    for comp in re.findall(r"\[([^\]]+)\]", patch.subject.split("] ")[0] + "]"):
        if comp.lower() in COMPONENT_TESTS:
            return COMPONENT_TESTS[comp.lower()]
    weight: dict[str, int] = {}
    for block in re.split(rb"(?m)^(?=diff --git )", patch.raw):
        m = DIFF_GIT.match(block)
        if not m or b"\ndeleted file mode " in block.split(b"\n@@", 1)[0]:
            continue
        path = m.group(2).decode()
        if path.startswith("vllm/") and path.endswith(".py"):
            weight[path] = sum(
                1
                for ln in block.split(b"\n")[1:]
                if ln[:1] in (b"+", b"-") and not ln.startswith((b"+++ ", b"--- "))
            )
    if not weight:
        return "tests"
    parts = PurePosixPath(max(weight, key=weight.__getitem__)).parts[1:-1]
    for k in range(len(parts), 0, -1):
        d = "tests/" + "/".join(parts[:k])
        if git("cat-file", "-e", f"{rev}:{d}", cwd=repo, check=False).returncode == 0:
            return d
    return "tests/" + "/".join(parts[:2]) if parts else "tests"


def git_identity(repo: Path) -> tuple[str, str] | None:
    """The submitter: $GIT_AUTHOR_NAME / _EMAIL, else $GIT_COMMITTER_*,
    else git's user.name and user.email (as git commit takes them)."""
    for who in ("AUTHOR", "COMMITTER"):
        name = os.environ.get(f"GIT_{who}_NAME", "").strip()
        email = os.environ.get(f"GIT_{who}_EMAIL", "").strip()
        if name and email:
            return name, email
    name = git("config", "user.name", cwd=repo, check=False).stdout.decode()
    email = git("config", "user.email", cwd=repo, check=False).stdout.decode()
    if name.strip() and email.strip():
        return name.strip(), email.strip()
    return None


def export_ref(repo: Path, name: str, force: bool) -> str:
    if git("check-ref-format", "--branch", name, cwd=repo, check=False).returncode != 0:
        raise UserError(f"'{name}' is not a valid branch name")
    ref = f"refs/heads/{name}"
    for ln in gout("worktree", "list", "--porcelain", cwd=repo).splitlines():
        if ln == f"branch {ref}":
            raise UserError(
                f"branch '{name}' is checked out in a worktree of "
                f"{repo}; pick another --branch"
            )
    if not ref.startswith(REF_NS + "/") and rev_commit(repo, ref) and not force:
        raise UserError(
            f"branch '{name}' exists and is not the tool's (not "
            f"under {REF_NS[len('refs/heads/') :]}/): pick another "
            "--branch, or --force to overwrite it"
        )
    return ref


def export_stem(series: Series, entry: str) -> str:
    """The name of the patch's branch and files: its stack and file stem
    (tq-v0.33-0003-turboquant-...), one scheme for every patch."""
    return f"{Path(entry).parent.name}-{Path(entry).stem}"


def cmd_export(args: argparse.Namespace) -> int:
    """apply.py export: the patch as one PR commit on a branch, with its
    regression tests adapted, its PR description and its patch file; with
    --onto, that commit carried onto another commit of the repository."""
    job = export_job(args)
    base = export_base(args, job.stack, job.entry)
    stem = export_stem(job.series, job.entry)
    branch = args.branch or f"{REF_NS[len('refs/heads/') :]}/pr/{stem}"
    ref = export_ref(base.repo, branch, args.force)
    signoff = submitter(base.repo)
    onto = None
    if args.onto:
        onto = rev_commit(base.repo, args.onto)
        if onto is None:
            raise UserError(f"--onto {args.onto}: unknown revision in {base.repo}")
    python = test_python(args.python)
    with locked(repo_lock(base.repo)):
        pr = make_pr_commit(job, base, args, signoff, python)
        if pr is None:
            return 1
        if onto is not None:
            pr = carry_onto(job, base, pr, (args.onto, onto), signoff)
            if pr is None:
                return 1
        msg = f"apply.py export {job.entry}"
        git("update-ref", "-m", msg, ref, pr.commit, cwd=base.repo)
    body_file, patch_file = export_files(base, stem, pr.body, pr.commit)
    exported = Exported(
        entry=job.entry,
        ref=ref,
        branch=branch,
        commit=pr.commit,
        parent=pr.parent,
        base=base,
        needs=pr.needs,
        placed=pr.tests.placed,
        update=pr.tests.update,
        body_file=body_file,
        patch_file=patch_file,
        onto=args.onto or "",
    )
    report_export(exported, job.patch, pr.dropped, signoff, stem)
    if args.run_tests:
        print(tests_before_and_with(job, base, pr, args, python))
    if args.json:
        Path(args.json).write_text(
            json.dumps(exported.as_json(job.patch), indent=2) + "\n"
        )
    shipped = {f: (pr.wt / f).read_text(errors="replace") for f in pr.tests.kept}
    return max(not_standalone(pr.body, shipped), 0 if pr.tests_ok else 1)


def tests_before_and_with(
    job: ExportJob, base: Base, pr: PrCommit, args: argparse.Namespace, python: str
) -> str:
    """What --run-tests found (run again on --onto's commit when given), and
    what is wrong when a test did not fail before and pass with the change."""
    where = f"on {base.rev}"
    if args.onto:
        ids = pr.tests.node_ids(job.patch)
        key, where = f"{job.stack.name}-onto", f"on {args.onto}"
        if fix_elsewhere(job.patch):  # the tests alone: they must fail there
            pr.proof = fail_without_fix(pr.wt, ids, python)
        else:
            pr.proof = before_and_with(base.repo, key, pr.parent, pr.wt, ids, python)
    text = f"{where}: {pr.proof.table}"
    if pr.proof.ok:
        return text
    if pr.proof.skipped:
        return (
            f"{text}\nnot proven here: a regression test skips on this host "
            "(the table says why); run export --run-tests where it runs"
        )
    return (
        f"{text}\nnot ready: a regression test did not fail before and pass "
        "with the change under plain pytest"
    )


def submitter(repo: Path) -> tuple[str, str]:
    """The git identity that signs the PR off (vLLM's DCO): exit 2 without."""
    ident = git_identity(repo)
    if ident is None:
        raise UserError(
            f"no git identity to sign off with in {repo}: set git config "
            "user.name and user.email (vLLM asks for a DCO sign-off by the "
            "submitter)"
        )
    return ident


@dataclasses.dataclass
class PrCommit:
    """The PR commit on its parent, with what went into it."""

    commit: str
    parent: str
    wt: Path  # a worktree holding the PR's tree (its index too)
    body: str
    dropped: list[str]
    tests: PlacedTests
    needs: list[Patch]
    proof: Proof | None = None  # --run-tests: what plain pytest found

    @property
    def tests_ok(self) -> bool:
        """Not run, or failed before and passed with the change."""
        return self.proof is None or self.proof.ok

    @property
    def result(self) -> str | None:
        """The outcomes' table for the PR text, where they prove something
        (a test skipped on this host proves nothing: left out)."""
        proven = self.proof is not None and not self.proof.skipped
        return self.proof.table if proven else None


def make_pr_commit(
    job: ExportJob,
    base: Base,
    args: argparse.Namespace,
    signoff: tuple[str, str],
    python: str,
    alone: bool = True,
) -> PrCommit | None:
    """The patch applied (on the patches it needs), its tests placed in
    vLLM's tree, and one commit with the PR message; None where it does
    not apply. With --run-tests, a patch that applies alone but whose tests
    do not pass there is based on the patches before it instead."""
    applied = apply_for_export(job, base, alone)
    if applied is None:
        return None
    wt, needs = applied
    am_commit = gout("rev-parse", "HEAD", cwd=wt)
    parent = gout("rev-parse", "HEAD~1", cwd=wt)
    dest = args.test_dir or vllm_test_dir(wt, am_commit, job.patch)
    check_safe_relpath(dest, "--test-dir")
    if job.kept:
        tests = place_kept_tests(job, wt)
    else:
        tests = place_tests(job, wt, am_commit, dest)
    tests.update = carry_test_update(job, wt)
    pr = PrCommit("", parent, wt, "", [], tests, needs)
    ids = tests.node_ids(job.patch)
    if args.run_tests:
        key = f"{job.stack.name}-export"
        change = "with the fix" if fix_elsewhere(job.patch) else "with this change"
        pr.proof = before_and_with(base.repo, key, parent, wt, ids, python, change)
        if not pr.tests_ok and not needs and len(job.upto) > 1:
            print(
                f"{job.entry}: its regression tests do not fail before and pass "
                "with it on the base alone: basing it on the patches before it"
            )
            return make_pr_commit(job, base, args, signoff, python, alone=False)
    msg = gout("log", "-1", "--format=%B", am_commit, cwd=wt)
    fix_pr = fix_elsewhere(job.patch)
    message, pr.body, pr.dropped = pr_message(
        job.patch,
        msg,
        ids,
        pr.result,
        signoff,
        needs,
        tests.renames,
        fix_pr,
        kept_test=bool(tests.kept),
    )
    tree = tests_only_tree(wt, am_commit, parent) if fix_pr else None
    pr.commit = pr_commit(wt, am_commit, parent, message, signoff, tree)
    return pr


def fix_elsewhere(patch: Patch) -> str | None:
    """The upstream PR that already carries the patch's fix (its header's
    'Upstream-Status: Submitted [URL]'): the export then holds the
    regression tests alone, offered to that PR."""
    status = (patch.values("Upstream-Status") or [""])[0]
    m = re.fullmatch(r"Submitted \[(\S+)\]", status)
    return m.group(1) if m else None


def tests_only_tree(wt: Path, am_commit: str, parent: str) -> str:
    """`parent`'s tree with the files the worktree's index adds over the
    patch's commit (the placed tests and their helpers), without the fix."""
    added = gout(
        "diff", "--cached", "--name-only", "--diff-filter=A", am_commit, cwd=wt
    ).split()
    with tempfile.TemporaryDirectory(prefix="vllm-patches-index-") as d:
        env = {"GIT_INDEX_FILE": str(Path(d) / "index")}
        git("read-tree", parent, cwd=wt, env=env)
        git("add", "-f", "--", *added, cwd=wt, env=env)
        return gout("write-tree", cwd=wt, env=env)


def carry_onto(
    job: ExportJob,
    base: Base,
    pr: PrCommit,
    onto: tuple[str, str],
    signoff: tuple[str, str],
) -> PrCommit | None:
    """The PR commit cherry-picked onto `onto` (name, commit): vLLM's main or
    any commit of the repository, with the patch's update of vLLM's tests
    where the PR's base had not those tests and `onto` has. None, naming
    where it conflicts, when it does not apply there."""
    name, commit = onto
    wt = worktree(base.repo, f"{job.stack.name}-export-onto", commit)
    date = gout("log", "-1", "--format=%cd", "--date=raw", pr.commit, cwd=wt)
    env = {
        "GIT_COMMITTER_NAME": signoff[0],
        "GIT_COMMITTER_EMAIL": signoff[1],
        "GIT_COMMITTER_DATE": date,
    }
    p = git("cherry-pick", "--allow-empty", pr.commit, cwd=wt, check=False, env=env)
    if p.returncode != 0:
        spots = conflict_spots(wt)
        git("cherry-pick", "--abort", cwd=wt, check=False)
        git("reset", "-q", "--hard", commit, cwd=wt)
        err = p.stderr.decode(errors="replace").strip().splitlines()
        why = "conflicts at " + ", ".join(spots) if spots else (err or ["?"])[0]
        print(f"{job.entry} does not apply on {name} ({commit[:12]}): {why}")
        return None
    tests = pr.tests
    if tests.update.startswith(f"{upstream_diff(job.entry)} not carried"):
        tests = dataclasses.replace(tests, update=carry_test_update(job, wt))
        if "applied" in tests.update:  # this tree has vLLM's tests: amend
            amend = ["commit", "-q", "--amend", "--no-edit", "--no-verify"]
            git(*amend, cwd=wt, env=env, config=("commit.gpgSign=false",))
    moved = gout("rev-parse", "HEAD", cwd=wt)
    return dataclasses.replace(pr, commit=moved, parent=commit, wt=wt, tests=tests)


def conflict_spots(wt: Path) -> list[str]:
    """Where a cherry-pick left conflicts: file:line of each marker."""
    spots = []
    for f in gout("diff", "--name-only", "--diff-filter=U", cwd=wt).split():
        lines = (wt / f).read_text(errors="replace").splitlines()
        spots += [
            f"{f}:{i}" for i, ln in enumerate(lines, 1) if ln.startswith("<<<<<<<")
        ]
    return spots


def not_standalone(body: str, shipped: dict[str, str]) -> int:
    """1, saying where, when the PR text or the test files it ships (path
    -> text) name this project's paths or series (a PR is read alone), or
    a shipped test module sets environment variables at import (they leak
    into every test of the pytest process); else 0."""
    leaks = [("the PR text", ln) for ln in series_words(body)]
    for path, text in shipped.items():
        leaks += [(path, ln) for ln in series_words(text)]
        leaks += [(path, f"line {n}: sets {v} at import") for n, v in env_writes(text)]
    if leaks:
        print("the PR names this project or leaks environment variables (not ready):")
        for where, line in leaks:
            print(f"  {where}: {line[:120]}")
    return 1 if leaks else 0


ENV_WRITERS = ("setdefault", "update", "pop", "clear", "__setitem__")


def env_writes(text: str) -> list[tuple[int, str]]:
    """Where a module writes os.environ (or os.putenv) outside a function:
    (line, what) of each write made when it is imported."""
    found = []
    todo = list(ast.parse(text).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        target = None
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, ast.Subscript)), None)
            target = target.value if target is not None else None
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in (*ENV_WRITERS, "putenv")
        ):
            target = node.func if node.func.attr == "putenv" else node.func.value
        if target is not None and ast.unparse(target) in ("os.environ", "os.putenv"):
            found.append((node.lineno, ast.unparse(target)))
        todo += list(ast.iter_child_nodes(node))
    return sorted(found)


@dataclasses.dataclass
class ExportJob:
    """The patch to export, the stack's patches up to it, and the test files
    it carries."""

    series: Series
    stack: Stack
    entry: str
    upto: list[Patch]  # the stack's patches up to and including this one
    test_files: list[str]
    kept: list[str]  # its own test for vLLM (upstream_tests), when it has one

    @property
    def patch(self) -> Patch:
        """The patch to export."""
        return self.upto[-1]


def export_job(args: argparse.Namespace) -> ExportJob:
    """The patch the command line names, with regression tests that exist."""
    series = parse_series(Path(args.series))
    stack, entry = pick_patch(series, args.patch)
    patches = [load_patch(series, e) for e in stack.patches]
    idx = stack.patches.index(entry)
    patch = patches[idx]
    if not patch.regression:
        raise UserError(
            f"patches/{entry}: no 'Tests:' trailer, so no "
            "regression test to carry in the PR"
        )
    test_files = list(dict.fromkeys(t.split("::", 1)[0] for t in patch.regression))
    for f in test_files:
        check_safe_relpath(f, f"patches/{entry}: test")
        if not (series.root / f).is_file():
            raise UserError(f"patches/{entry}: test file {f} does not exist")
    kept = upstream_tests(series.root, entry)
    for f in kept:
        check_safe_relpath(f, f"tests/upstream/{entry}: test")
    return ExportJob(series, stack, entry, patches[: idx + 1], test_files, kept)


def export_base(args: argparse.Namespace, stack: Stack, entry: str) -> Base:
    """The patch's own pinned base when at hand (and no --base), else the
    stack's."""
    user_repo = find_user_repo(args.repo)
    fetched = fetched_dir(args)
    base = None
    pin = stack.file_pins.get(entry)
    if pin and not args.base:  # the patch's own base ('#@ pin'), when at hand
        try:
            base = resolve_base(
                dataclasses.replace(stack, pins=pin, file_pins={}),
                None,
                user_repo,
                args.offline,
            )
        except BaseUnavailable as e:
            say(
                f"apply.py export: {entry}'s own pin {pin['commit'][:12]} is "
                f"not at hand ({e.reason}): using the stack's base"
            )
    try:
        return base or resolve_base(stack, args.base, user_repo, args.offline, fetched)
    except BaseUnavailable as e:
        raise UserError(f"base unavailable: {e.reason} (to get it: {e.hint})") from None


def apply_for_export(
    job: ExportJob, base: Base, alone: bool = True
) -> tuple[Path, list[Patch]] | None:
    """A worktree with the patch applied on the base alone (unless not
    `alone`), else after the patches before it (those it needs); None where
    it applies neither way."""
    key = f"{job.stack.name}-export"
    wt = worktree(base.repo, key, base.commit)
    results = {p.file: PatchResult(p.file) for p in job.upto}
    if alone and not apply_stack(wt, [job.patch], results):
        return wt, []
    wt = worktree(base.repo, key, base.commit)
    results = {p.file: PatchResult(p.file) for p in job.upto}
    conflicts = apply_stack(wt, job.upto, results)
    if job.patch in conflicts:
        print(
            f"{job.entry}: does not apply on {base.rev}, alone or after "
            "the patches before it (conflicts in "
            f"{', '.join(results[job.entry].conflict_files) or '?'})"
        )
        return None
    return wt, [p for p in job.upto[:-1] if results[p.file].apply in ("clean", "3way")]


@dataclasses.dataclass
class PlacedTests:
    """The regression tests as placed in vLLM's tree."""

    placed: list[tuple[str, str, list[str]]]  # (vLLM path, series path, done)
    renamed: dict[str, str]  # series test file -> vLLM path
    renames: dict[str, str]  # series paths (tests, helpers) -> vLLM tree paths
    update: str = ""  # what became of the patch's update of vLLM's own tests
    kept: list[str] = dataclasses.field(default_factory=list)  # its own test

    def node_ids(self, patch: Patch) -> list[str]:
        """The patch's regression test ids, at their vLLM paths: its own
        test for vLLM's files where it has one."""
        if self.kept:
            return list(self.kept)
        return [
            self.renamed[t.split("::", 1)[0]] + t[len(t.split("::", 1)[0]) :]
            for t in patch.regression
        ]


def place_tests(job: ExportJob, wt: Path, am_commit: str, dest: str) -> PlacedTests:
    """Each test module adapted into `dest` of the worktree with the helpers
    it names beside it, staged."""
    tests = PlacedTests([], {}, {})
    for f in job.test_files:
        src = job.series.root / f
        name = src.name
        if (
            git(
                "cat-file", "-e", f"{am_commit}:{dest}/{name}", cwd=wt, check=False
            ).returncode
            == 0
        ):
            name = f"{src.stem}_regression.py"
        text, done = adapt_test_module(src, f)
        target = wt / dest / name
        if target.exists():
            raise UserError(
                f"{dest}/{name} already exists in the tree: give --test-dir"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        added = [f"{dest}/{name}"]
        for h in helper_paths(src):
            added += copy_helper(h, src, wt, dest)
            done.append(f"helper {h.name} copied alongside")
            tests.renames[(PurePosixPath(f).parent / h.name).as_posix()] = (
                f"{dest}/{h.name}"
            )
        git("add", "-f", "--", *added, cwd=wt)
        tests.placed.append((f"{dest}/{name}", f, done))
        tests.renamed[f] = tests.renames[f] = f"{dest}/{name}"
    return tests


def place_kept_tests(job: ExportJob, wt: Path) -> PlacedTests:
    """The patch's own test for vLLM (upstream_tests) copied as it is to its
    paths in the worktree, staged; the series' tests stay in the project."""
    src = job.series.root / upstream_test_dir(job.entry)
    tests = PlacedTests([], {}, {}, kept=job.kept)
    for rel in job.kept:
        if (wt / rel).exists():
            raise UserError(f"{rel} already exists in the tree: rename it in {src}")
        (wt / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, wt / rel)
        series_path = (src / rel).relative_to(job.series.root).as_posix()
        tests.placed.append((rel, series_path, ["written for vLLM, copied as it is"]))
    git("add", "-f", "--", *job.kept, cwd=wt)
    return tests


def carry_test_update(job: ExportJob, wt: Path) -> str:
    """The patch's update of vLLM's own tests (tests/upstream/<stack>/
    <patch>.diff) applied to the PR's tree and staged, where that tree has
    vLLM's tests; what became of it, or "" when the patch has none."""
    rel = upstream_diff(job.entry)
    diff = job.series.root / rel
    if not diff.is_file():
        return ""
    if not all((wt / f).is_file() for f in diff_files([diff])):
        return (
            f"{rel} not carried: this base has not the vLLM tests it updates "
            "(a release's wheel has no tests/); export in a vLLM clone to carry it"
        )
    p = git("apply", "--index", str(diff), cwd=wt, check=False)
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(f"{rel} does not apply to vLLM's tests here: {err[:1]}")
    return f"{rel} applied (vLLM's tests this change updates)"


def copy_helper(h: Path, src: Path, wt: Path, dest: str) -> list[str]:
    """A helper module or package of a test, copied into `dest`: its paths."""
    files = (
        [h]
        if h.is_file()
        else sorted(
            x
            for x in h.rglob("*")
            if x.is_file() and "__pycache__" not in x.parts and x.suffix != ".pyc"
        )
    )
    added = []
    for x in files:
        rel = x.relative_to(src.parent).as_posix()
        (wt / dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(x, wt / dest / rel)
        added.append(f"{dest}/{rel}")
    return added


def pr_commit(
    wt: Path,
    am_commit: str,
    parent: str,
    message: str,
    signoff: tuple[str, str],
    tree: str | None = None,
) -> str:
    """The staged tree (or `tree`) committed on `parent` with the PR message,
    committed by the one signing off; its author is the patch's where that
    is a person (a backport's), else (the series' own identity) the one
    signing off: vLLM's DCO check matches the author to a sign-off."""
    tree = tree or gout("write-tree", cwd=wt)
    who = gout(
        "log", "-1", "--format=%an%x00%ae%x00%ad", "--date=raw", am_commit, cwd=wt
    ).split("\0")
    if tuple(who[:2]) == IDENTITY:
        who[:2] = signoff
    env = {
        "GIT_AUTHOR_NAME": who[0],
        "GIT_AUTHOR_EMAIL": who[1],
        "GIT_AUTHOR_DATE": who[2],
        "GIT_COMMITTER_NAME": signoff[0],
        "GIT_COMMITTER_EMAIL": signoff[1],
        "GIT_COMMITTER_DATE": who[2],
    }
    return gout(
        "commit-tree", tree, "-p", parent, cwd=wt, env=env, input=message.encode()
    )


def export_files(base: Base, stem: str, body: str, commit: str) -> tuple[Path, Path]:
    """The PR description and the commit as a patch file, in the tool's cache."""
    out_dir = cache_dir() / "export"
    out_dir.mkdir(parents=True, exist_ok=True)
    body_file = out_dir / f"{stem}.md"
    body_file.write_text(body)
    patch_file = out_dir / f"{stem}.patch"  # the commit, exported as the series'
    patch_file.write_bytes(format_patch(base.repo, commit))
    return body_file, patch_file


@dataclasses.dataclass
class Exported:
    """What export made: the branch (ref, commit) and the files beside it."""

    entry: str
    ref: str
    branch: str
    commit: str
    parent: str
    base: Base
    needs: list[Patch]
    placed: list[tuple[str, str, list[str]]]
    update: str
    body_file: Path
    patch_file: Path
    onto: str = ""  # --onto: the revision the commit was carried onto

    def as_json(self, patch: Patch) -> dict:
        return {
            "patch": self.entry,
            "ref": self.ref,
            "repo": str(self.base.repo),
            "commit": self.commit,
            "parent": self.parent,
            "base": self.base.rev,
            "base_commit": self.base.commit,
            "needs": [p.file for p in self.needs],
            "tests": [{"file": d, "from": s, "adapted": a} for d, s, a in self.placed],
            "body_file": str(self.body_file),
            "patch_file": str(self.patch_file),
            "target": upstream_target(patch),
        }


def upstream_target(patch: Patch) -> str:
    """Where the change goes: the patch's 'Upstream-Target:', else vLLM's
    main."""
    return (patch.values("Upstream-Target") or ["vllm-project/vllm main"])[0]


def report_export(
    ex: Exported,
    patch: Patch,
    dropped: list[str],
    signoff: tuple[str, str],
    stem: str,
) -> None:
    base = ex.base
    subject = gout("log", "-1", "--format=%s", ex.commit, cwd=base.repo)
    print(f"{ex.ref} in {base.repo}")
    print(f"  {ex.commit[:12]} {subject}")
    if fix := fix_elsewhere(patch):
        print(
            f"  tests only: the fix is {fix} (Upstream-Status); they go to "
            "that PR (below)"
        )
    if ex.onto:
        on = f"{ex.onto} ({ex.parent[:12]})"
    elif ex.needs:
        on = f"{ex.needs[-1].file} ({ex.parent[:12]}) on {base.rev}"
    else:
        on = f"{base.rev} ({base.commit[:12]})"
    print(f"  parent: {on}")
    if ex.needs:
        print(
            f"  note: {ex.entry} does not apply on {base.rev} alone; the branch "
            f"is based on the patches before it: "
            f"{', '.join(p.file for p in ex.needs)} (open those PRs first, or "
            "say in this one that it depends on them)"
        )
    for dst, src, done in ex.placed:
        print(f"  test: {dst} (from {src}; " + ("; ".join(done) or "unchanged") + ")")
    if ex.update:
        print(f"  upstream tests: {ex.update}")
    if dropped:
        print(
            f"  left out of the PR message (about the series only): "
            f"{', '.join(dropped)}"
        )
    print(f"  signed off by: {signoff[0]} <{signoff[1]}>")
    print(f"  PR description: {ex.body_file}")
    print(f"  as a patch file: {ex.patch_file}")
    if patch.values("Upstream-Target"):
        print(f"target: {upstream_target(patch)}")
        print(
            "  not a PR against vllm-project/vllm main: the code it changes is "
            "not there. Offer the patch file and description where the target "
            "says."
        )
        return
    if base.source in ("cache", "pypi") and re.search(
        r"^Release: ",
        gout("log", "-1", "--format=%B", base.commit, cwd=base.repo),
        re.MULTILINE,
    ):
        print(
            f"  note: {base.repo} is the tool's cache: its {base.rev} is the "
            "release's Python sources (from the wheel), not vLLM's history. "
            "To open the PR, export in a vLLM clone "
            f"(apply.py export {ex.entry} --repo ~/src/vllm), or carry the "
            f"commit to a branch at {base.rev} there: git -C ~/src/vllm am -k "
            f"{ex.patch_file}"
        )
    if fix := fix_elsewhere(patch):
        print_offer_tests(ex, fix)
    print_open_pr(ex, subject, fix)


def print_offer_tests(ex: Exported, fix: str) -> None:
    """Tests of a fix another PR carries go to that PR: on main without
    its fix they fail, so they are no PR of their own until it merges."""
    number = fix.rstrip("/").rsplit("/", 1)[-1]
    patch_file = shlex.quote(str(ex.patch_file))
    print(
        f"to add the tests to {fix} (they fail on main without its fix): in "
        "your vLLM clone,"
    )
    print(f"  gh pr checkout {number} --repo vllm-project/vllm")
    print(f"  git am -k {patch_file}")
    print(
        "  then push onto that PR's branch if its author lets you, or attach "
        f"{patch_file} to a review comment there"
    )


def print_open_pr(ex: Exported, subject: str, fix: str | None = None) -> None:
    """The commands that push the branch and open the PR (for tests of a
    fix another PR carries: once that PR is merged)."""
    remote_branch = (
        ex.branch.split("/", 1)[1]
        if ex.branch.startswith(REF_NS[len("refs/heads/") :] + "/")
        else ex.branch
    )
    when = f" once {fix} is merged, and not before" if fix else ""
    print(
        f"to open the PR{when} (vLLM takes PRs against main: rebase the branch "
        "there first if its base is a release):"
    )
    print(
        f"  git -C {shlex.quote(str(ex.base.repo))} push YOUR_FORK_REMOTE "
        f"{ex.ref}:refs/heads/{remote_branch}"
    )
    print(
        f"  gh pr create --repo vllm-project/vllm --base main --head "
        f"YOUR_GITHUB_USER:{remote_branch} --title {shlex.quote(subject)} "
        f"--body-file {shlex.quote(str(ex.body_file))}"
    )


def add_deliver_commands(sub: argparse._SubParsersAction) -> None:
    """The delivery commands: wheel, export."""
    add_wheel_command(sub)
    add_export_command(sub)


def add_wheel_command(sub: argparse._SubParsersAction) -> None:
    """apply.py wheel: a patched vLLM wheel from the official one."""
    w = command(
        sub,
        "wheel",
        cmd_wheel,
        help="patched vLLM wheel from the official one (no CUDA build)",
        description="Apply a stack and write the official vLLM wheel of the "
        "base's release with exactly the files the patched tree changes "
        "replaced (new ones added, deleted ones removed), a PEP 440 local "
        "version naming the series (<release>+<stack>.<hash>) in its metadata "
        "and vllm/_version.py, and RECORD regenerated by 'wheel pack'. Refuses "
        "a series that changes compiled sources (csrc/, CMake, *.cu, *.cpp, "
        "setup.py) and a wheel of another version. Needs the 'wheel' package "
        "(>=0.48) in the --python.",
        epilog="example:\n  python apply.py wheel --stack tq --out dist\n"
        "  python apply.py wheel --base v0.20.2 --from-wheel "
        "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl",
    )
    add_wheel_options(w)
    w.add_argument(
        "--force",
        action="store_true",
        help="ship base + patch even where the wheel's copy of a changed file "
        "differs from the base tree's",
    )


def add_export_command(sub: argparse._SubParsersAction) -> None:
    """apply.py export: one upstream PR branch for one patch."""
    e = command(
        sub,
        "export",
        cmd_export,
        help="one upstream PR branch for one patch",
        description="Create a branch (default refs/heads/patched/pr/<stack>-"
        "<patch>) in the vLLM repository (--repo, else the tool's cache) with "
        "the patch as "
        "one commit on the stack's base (or on the patches before it, when it "
        "only applies there), its message in vLLM's PR template (Purpose, Test "
        "Plan, Test Result; FIX #N from Bug: issues), signed off, and its "
        "regression test adapted into vLLM's tests/. Prints the push and "
        "PR-creation commands. The checkout, its index and other branches are "
        "never touched.",
        epilog="example:\n  python apply.py export tq/0001 --repo ~/src/vllm\n"
        "  git -C ~/src/vllm log -1 -p patched/pr/tq-0001-...",
    )
    e.add_argument("patch", help="patch file name or unique prefix")
    e.add_argument("--branch", help="branch name (default: patched/pr/<stack>-<patch>)")
    common(e, "base")
    e.add_argument(
        "--onto",
        metavar="REV",
        help="carry the PR commit onto REV of the repository (vLLM's main, "
        "or any commit): the branch is based there, or exit 1 naming where "
        "it conflicts",
    )
    e.add_argument(
        "--test-dir",
        help="where the test goes in vLLM's tree "
        "(default: by the subject's [Component], else tests/ "
        "mirroring the changed module)",
    )
    e.add_argument(
        "--run-tests",
        action="store_true",
        help="run the exported regression tests with plain pytest in vLLM's "
        "tree before and with the change (exit 1 unless they fail before and "
        "pass with it) and put the results in Test Result",
    )
    e.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing branch outside the tool's namespace",
    )
    common(e, "repo", "python", "offline", "json", "fetched")
