#!/usr/bin/env python3
"""apply.py: apply, verify and carry a series of vLLM patches.

The series file lists patches (git format-patch files under patches/) in
stacks, each pinned to a vLLM base. This tool applies a stack onto a base in a
worktree of its own, runs each patch's targeted tests against the patched tree
and its regression tests against the unpatched base, prints a table, writes a
JSON report and leaves the result as a branch in its own ref namespace
(refs/heads/patched/<stack>/<base>). It never changes the user's checkout.

Examples:
    python apply.py                          # every stack at its pinned base
    python apply.py --base v0.20.2 --repo ~/src/vllm --json report.json
    python apply.py check                    # lint the series (pre-commit)
    python apply.py test --tree ~/src/vllm   # targeted tests against a tree
    python apply.py base v0.21.0             # obtain a release base offline

Standard library and git only. This file is the entry point; the code is in
applylib/ beside it, one module per responsibility (docs/layout.md).
Exit codes: 0 all good; 1 a patch conflicted or a test failed; 2 bad input or
environment (one line on stderr).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from applylib.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
