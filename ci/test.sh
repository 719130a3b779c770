#!/usr/bin/env bash
# All tests: sets up .venv if needed, lints the series, runs the main job on
# the real series (every patch's regression test on the tree before it and
# with it; the table is printed, the report kept in build/), checks the docs
# against the code (ci/docs_check.py), runs vLLM's own tests of the modules
# the TurboQuant stacks change (apply.py upstream), the mutants, then the
# tool's tests and the checks of that report.
#
# Hermetic: the tool's cache (bases, worktrees, release wheels) and vLLM's,
# Triton's and torch.compile's caches start empty under build/ci/ on every
# run, so nothing in the home directory can change an outcome; only pip's
# download cache is shared (the release wheels come through pip).
# VLLM_PATCHES_CI_WARM=1 keeps build/ci/ from the previous run (faster
# local reruns; not what CI does).
set -uo pipefail
cd "$(dirname "$0")/.."
# Each stage's wall time, for the table in CI's last lines (ci/summary.py).
mkdir -p build && : > build/stages.tsv
t=$(date +%s)
lap() { local now; now=$(date +%s); printf '%s\t%s\n' "$1" $((now - t)) >> build/stages.tsv; t=$now; }
bash ci/setup.sh || exit 1
# the serving image is built for real (tests/tool/test_image.py): buildah and
# mmdebstrap (its stand-in base), from apt where this runs as root
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get install -y -q buildah mmdebstrap >/dev/null ||
      { apt-get update -q && apt-get install -y -q buildah mmdebstrap; } >/dev/null; } ||
      echo "ci/test.sh: apt-get could not install buildah and mmdebstrap"
  fi
  command -v buildah >/dev/null ||
    echo "ci/test.sh: no buildah: the image build test will be skipped"
fi
lap set-up
ci=$PWD/build/ci
[ -n "${VLLM_PATCHES_CI_WARM:-}" ] || rm -rf "$ci"
mkdir -p "$ci"
# what a run writes under build/ is in docs/testing.md#ci; a full disk fails late
df -Pk "$ci" | awk 'NR == 2 {printf "ci/test.sh: %.1f GB free under build/\n", $4 / 1048576}'
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/pip}
export VLLM_PATCHES_CACHE=$ci/vllm-patches XDG_CACHE_HOME=$ci/xdg
export VLLM_CACHE_ROOT=$ci/vllm TRITON_CACHE_DIR=$ci/triton
export TORCHINDUCTOR_CACHE_DIR=$ci/inductor HF_HUB_OFFLINE=1
# The dsv4 stack's pre-fix files, where they lie beside the project.
if [ -z "${VLLM_PATCHES_FETCHED:-}" ] && [ -d ../shared/fixtures/dsv4 ]; then
  export VLLM_PATCHES_FETCHED=$(cd ../shared/fixtures/dsv4 && pwd)
fi
.venv/bin/python apply.py --require-all --json build/report.json 2>&1 | tee build/report.txt
main=${PIPESTATUS[0]}
lap "main job"
# after the main job, so the bases are at hand for the export round-trip
.venv/bin/python apply.py check
check=$?
lap "apply.py check"
# the docs: commands parse, paths and links exist, the spec is the parser's
.venv/bin/python ci/docs_check.py 2>&1 | tee build/docs_check.txt
docs=${PIPESTATUS[0]}
lap "docs check"
# vLLM's own tests of the modules the TurboQuant stacks change (from each
# release's sdist): none that passes on the base may fail patched
.venv/bin/python apply.py upstream tq-v0.33 tq 2>&1 | tee build/upstream.txt
upstream=${PIPESTATUS[0]}
lap "vLLM's tests"
# every mutant of every patch must be killed by the patch's own tests
.venv/bin/python apply.py mutants --json build/mutants.json 2>&1 | tee build/mutants.txt
mutants=${PIPESTATUS[0]}
lap mutants
# the tool's tests, one file per worker, as many workers as apply.py's lanes
# (the eight slowest named);
# the patch tests need a vLLM tree: the main job and the mutants ran them,
# and the summary's lines, last, say how many; the patches' own tests for
# vLLM (tests/upstream/) run in vLLM's tree: apply.py upstream ran them
jobs=$(.venv/bin/python -c 'from applylib.lanes import lanes; print(lanes())') || exit 2
VLLM_PATCHES_REPORT=build/report.json .venv/bin/python -m pytest -q -ra tests \
  --ignore=tests/patches --ignore=tests/upstream -n "$jobs" --dist loadfile \
  --durations=8 "$@"
tests=$?
lap "tool tests"
.venv/bin/python ci/summary.py build
[ "$main" -eq 0 ] || echo "ci/test.sh: the main job failed (exit $main)"
[ "$check" -eq 0 ] || echo "ci/test.sh: apply.py check failed (exit $check)"
[ "$docs" -eq 0 ] || echo "ci/test.sh: the docs check failed (exit $docs)"
[ "$mutants" -eq 0 ] || echo "ci/test.sh: a mutant survived (exit $mutants)"
[ "$upstream" -eq 0 ] || echo "ci/test.sh: a vLLM test fails patched (exit $upstream)"
[ "$main" -eq 0 ] && [ "$check" -eq 0 ] && [ "$docs" -eq 0 ] &&
  [ "$mutants" -eq 0 ] && [ "$upstream" -eq 0 ] && exit $tests
exit 1
