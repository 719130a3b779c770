#!/bin/bash
# The v0.26.0 variants of the engine's silent-wrong-output calls (CALLS
# "spec" of scenarios.py) as overlay folders for ci/gpu/stage.py releases
# (--overlay v0.26.0:VARIANT=OUT/VARIANT):
#   kvfix    v0.26.0 + ports/v0.26.0-tq-kv-shape-v1-runner.diff: vllm#50709
#            ("Unknown TurboQuant cache dtype: 'auto'") on the V1 model
#            runner, which ngram speculative decoding needs on v0.26.0 (no
#            ngram on V2 there); fixed upstream from v0.27.0 (#50533)
#   patched  kvfix + tq-v0.33/0002 and 0003 as
#            `apply.py --base v0.26.0 --stack tq-v0.33` applies them (0002
#            3-way, 0003 clean; 0001 conflicts there, and their regression
#            tests fail on v0.26.0 and pass with the two alone)
# From the repository root, after that apply.py run:
#   VLLM_PATCHES_CACHE=... bash ci/gpu/engine/overlays.sh OUT
set -euo pipefail
OUT=$1
GIT=(git -C "${VLLM_PATCHES_CACHE:?}/vllm.git")
REF=refs/heads/patched/tq-v0.33/v0.26.0
DIFF=$(cd "$(dirname "$0")" && pwd)/ports/v0.26.0-tq-kv-shape-v1-runner.diff
RUNNER=vllm/v1/worker/gpu_model_runner.py
want=$'[Attention][TurboQuant] Fast path only for batches without cached context\n[Attention][TurboQuant] Capture full graphs on the context-aware prefill branch'
got=$("${GIT[@]}" log --format=%s "v0.26.0..$REF")
if [ "$got" != "$want" ]; then
  echo "overlays.sh: $REF is not v0.26.0 + tq-v0.33/0002 + 0003:"; echo "$got"; exit 2
fi
mapfile -t changed < <("${GIT[@]}" diff --name-only v0.26.0 "$REF")
rm -rf "$OUT/kvfix" "$OUT/patched"
mkdir -p "$OUT/kvfix" "$OUT/patched"
"${GIT[@]}" archive v0.26.0 "$RUNNER" | tar -x -C "$OUT/kvfix"
"${GIT[@]}" archive "$REF" "$RUNNER" "${changed[@]}" | tar -x -C "$OUT/patched"
for v in kvfix patched; do
  patch -s -p1 -d "$OUT/$v" < "$DIFF"
  echo "$OUT/$v: $(cd "$OUT/$v" && find vllm -type f | sort | tr '\n' ' ')"
done
