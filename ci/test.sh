#!/usr/bin/env bash
# All tests: sets up .venv if needed, lints the series, runs the main job on
# the real series (every patch's regression test on the unpatched base and on
# the patched tree; the table is printed, the report kept in build/), then the
# tool's tests and the checks of that report. Offline once the vLLM release
# wheels are in the tool's cache (~/.cache/vllm-patches) or pip's reach.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh || exit 1
.venv/bin/python apply.py check || exit 1
mkdir -p build
.venv/bin/python apply.py --json build/report.json 2>&1 | tee build/report.txt
main=${PIPESTATUS[0]}
VLLM_PATCHES_REPORT=build/report.json .venv/bin/python -m pytest -q -ra tests "$@"
tests=$?
if [ "$main" -ne 0 ]; then echo "ci/test.sh: the main job failed (exit $main)"; fi
[ "$main" -eq 0 ] && exit $tests || exit 1
