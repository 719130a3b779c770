#!/usr/bin/env bash
# Creates or updates the test environment in .venv (idempotent, fast when
# nothing changed): CPU PyTorch, Triton, pytest, hypothesis and the
# import-time dependencies of the vLLM modules the patches touch.
#
# torch: `pip install torch==2.13.0` takes the CPU build where one is on disk
# or on the configured index. Elsewhere, point pip at PyTorch's CPU wheel index
# first (PIP_EXTRA_INDEX_URL=<that index>) or set TORCH_SPEC to another
# requirement, e.g. TORCH_SPEC="torch==2.13.0+cpu".
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.setup-stamp
want=$( (cat ci/requirements-cpu.txt; echo "${TORCH_SPEC:-torch==2.13.0}") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "ci/setup.sh: installing the test environment into .venv" >&2
  pipi() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v "^WARNING: Location" >&2); }
  pipi "${TORCH_SPEC:-torch==2.13.0}"
  pipi -r ci/requirements-cpu.txt
  echo "$want" > "$stamp"
fi
