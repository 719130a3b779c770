#!/bin/bash
# ONE device call of the engine campaign (ci/gpu/README.md), from the
# repository root:
#   bash ci/gpu/engine/device/call.sh CALL [BUDGET_S]
#   JOBS=v0.20.2:patched:m1,... bash ci/gpu/engine/device/call.sh CALL [BUDGET_S]
# carry: [".dev/eng/CALL"] (a CALL without a carry folder only runs jobs).
# Applies the carry (stage_setup.py: exit 20 and "STAGE LOST" if an earlier
# carry is missing on this machine), then runs CALL's scenarios (campaign.py,
# or $JOBS) with driver.py inside BUDGET_S seconds (default campaign.BUDGET)
# counted from the start of this script. Writes to $OUT: CALL_setup.log,
# CALL_results.json, CALL_table.md, CALL_logs.tar.gz.
set -u
CALL=$1
BUDGET=${2:-$(cd "$(dirname "$0")/.." && python3 -c "import campaign,sys; print(campaign.BUDGET.get(sys.argv[1], 300))" "$CALL")}
T0=$(date +%s)
cd "$(dirname "$0")/../../../.."
source ci/gpu/engine/device/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$ENG_ROOT"
{
  echo "== $CALL $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>/dev/null)"
  if [ ! -f "$ENG_ROOT/.env_printed" ]; then
    python3 -c 'import sys,torch,triton;print("python",sys.version.split()[0],"torch",torch.__version__,"cuda",torch.version.cuda,"triton",triton.__version__)'
    python3 - <<'PY'
import importlib.metadata as md
for p in ["numba","llvmlite","numpy","transformers","tokenizers","huggingface-hub","torchvision","typing-extensions","cloudpickle","psutil","anyio","httpx","safetensors"]:
    try: print(" ", p, md.version(p))
    except Exception: print(" ", p, "MISSING")
PY
    touch "$ENG_ROOT/.env_printed"
  fi
} 2>&1 | tee -a "$OUT/${CALL}_setup.log"
python3 ci/gpu/engine/device/stage_setup.py --carry ".dev/eng/$CALL" 2>&1 | tee -a "$OUT/${CALL}_setup.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  [ "$rc" -eq 20 ] && echo "STAGE LOST (exit 20): restart the campaign at c1"
  echo "setup of $CALL failed: exit $rc"; exit "$rc"
fi
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
python3 ci/gpu/engine/driver.py --call "$CALL" --deadline "$LEFT" --out "$OUT" ${JOBS:+--jobs "$JOBS"}
echo "== $CALL done in $(( $(date +%s) - T0 )) s"
