#!/usr/bin/env bash
# The GPU rig's one entry point: the device tool's `run`, from the repository
# root, with what ci/gpu/stage.py staged carried (ci/gpu/README.md):
#
#   bash ci/gpu/run.sh PARTS [DEADLINE_S]
#
# PARTS, a comma list (carry .gpu and .whl):
#   tests      every staged tree's targeted tests on CUDA (.gpu/NAME.tests)
#   batches    test_tq_batches.py's long mode on the patched trees
#              (TQ_BATCH_EXAMPLES a test, 100)
#   cudagraph  tq_cudagraph.py on each staged base/patched pair (v0.20.2's:
#              cg_*, v0.33.0's: cg33_*), uq_cudagraph.py on v0.33.0's
#   bench      tq_continuation_bench.py: (c) patched, (b) the later release
#              (v0.21.0 / v0.33.0), (a) v0.20.2; BENCH_MODES (sdpa,fa)
#   decode     tq_decode_bench.py on tq33-patched: DECODE_PRESETS,
#              DECODE_CELLS, DECODE_SWEEP=0 (no sweep), DECODE_PEER=.peer
#              (vllm#53060's decode too, ci/gpu/peer_stage.sh; carry .peer),
#              DECODE_ARGS (more of the bench's flags, e.g. --prev FILE)
#   store      tq_store_bench.py: v0.33.0's slot store and its SoA store
#              (raw and folded norms) on tq33-patched (STORE_CAP s)
#   accuracy   tq_decode_accuracy.py (ACC_ARGS), then the decode bench on
#              ACC_BENCH_TREES at ACC_BENCH_CELLS
#   sinks      tq_decode_accuracy.py on trained-model data (--data: sinks,
#              windows, small/large/outlier values), bf16 (SINK_BF16: more
#              flags) then fp16 (SINK_FP16), SINK_CAP s each; SINK_PREV=FILE:
#              another grouped decode module beside the tree's ("prev");
#              SINK_VARIANTS="NAME=FILE ...": more (tq_plane_decode.py's);
#              SINK_RUNS="NAME:DTYPE ...": these runs instead, each with the
#              flags in $SINK_NAME and cap SINK_CAP_NAME (default SINK_CAP;
#              out: sinks_NAME); ACC_BASE as for accuracy
#   profile    ncu on the grouped decode's stage 1 (PROF_CELL, 32x32768;
#              PROF_PEER=.peer: vllm#53060's decode kernels too, carry .peer);
#              PROF_RUNS="NAME:PRESET:D:GQA ...": the registers stage 1 as
#              served instead (profile_regs; TQ_SOA_NAME=FILE: a candidate)
#   upstream   vLLM's own tests of what tq-v0.33 changes, tq33-base against
#              tq33-patched (upstream_tests.py; UP_TESTS: v0.33.0's tests/
#              as a tarball, results/upstream-2026-11-29/README.md)
#   engine     the release wheels' engine (carry .dev/eng/CALL, or none):
#              CALL=NAME applies that carry (engine/setup.py), then runs
#              engine/scenarios.py's CALLS[NAME] or JOBS (engine/driver.py)
#   none       the trees and wheels unpacked, nothing run
# DEADLINE_S (570): each part gets what is left, so the summary is always
# written: $OUT/tables.md and JSON (ci/gpu/summarize.py), run.log,
# logs.tar.gz; the engine's CALL_* files. SMALL=1: the scripts' CPU shapes.
set -u
cd "$(dirname "$0")/../.."
parts=${1:-cudagraph,bench,tests}
deadline=$(( $(date +%s) + ${2:-570} ))
OUT=${OUT:-/tmp/gpu-out} W=/tmp/gpuwork T=/tmp/trees PY=${PY:-python3}
SMALL_ARG=${SMALL:+--small}
# v0.33.0's decode kernel, the suite's baseline (a file where tq33-base is not staged)
ACC_BASE=${ACC_BASE:-$T/tq33-base/vllm/v1/attention/ops/triton_turboquant_decode.py}
rm -rf "$W"; mkdir -p "$OUT" "$W" "$T"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/tmp/site
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
echo "== $(date -u +%FT%TZ) $gpu"

left() { echo $(( deadline - $(date +%s) - ${1:-0} )); }
# run NAME CAP CMD...: CMD with a timeout of min(CAP, time left - 25 s), its
# output in $W/NAME.log, "NAME rc seconds" in $W/rc
run() {
  local name=$1 cap=$2 t s rc; shift 2
  t=$(left 25); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 15 ]; then echo "== $name: not run (deadline)"; echo "$name" >> "$W/not_run"; return; fi
  echo "== $name (timeout ${t}s): $*"
  s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - s ))s"
  [ $rc -ne 0 ] && tail -n 15 "$W/$name.log"
  echo "$name $rc $(( $(date +%s) - s ))" >> "$W/rc"
}
# pt NAME TREE PYTEST-ARGS...: targeted tests against one tree. PYTHONPATH:
# vLLM inspects model classes in a subprocess, which must import that tree.
pt() {
  local name=$1 tree=$2; shift 2
  echo "$name" >> "$W/suites"
  run "$name" "${PT_CAP:-240}" env VLLM_TREE="$T/$tree" VLLM_BASE_TREE="${BASE_TREE:-}" \
    PYTHONPATH="$T/$tree:/tmp/site" $PY -m pytest -q -p no:cacheprovider -o addopts= \
    --junitxml="$W/junit_$name.xml" -rfE "$@"
}
have() { [ -d "$T/$1/vllm" ]; }

part_tests() {  # tq/0002's bit-exact test compares tq-patched with tq-0001
  local f n
  for f in .gpu/*.tests; do
    n=$(basename "$f" .tests)
    [ -s "$f" ] && have "$n" || continue
    BASE_TREE=$([ "$n" = tq-patched ] && have tq-0001 && echo "$T/tq-0001") \
      pt "$n" "$n" $(cat "$f")
  done
}
part_batches() {
  local t
  for t in tq-patched tq33-patched; do
    have $t && PT_CAP=300 TQ_BATCH_EXAMPLES=${TQ_BATCH_EXAMPLES:-100} \
      pt "batches_${t%-patched}" $t tests/patches/test_tq_batches.py
  done
}
part_cudagraph() {
  local v side
  for v in cg:tq cg33:tq33; do
    for side in base patched; do
      have "${v#*:}-$side" && run "${v%%:*}_$side" 150 $PY ci/gpu/tq_cudagraph.py \
        --tree "$T/${v#*:}-$side" --label $side --out "$W/${v%%:*}_$side.json" \
        --samples "$W/${v%%:*}_samples_$side.pt" $SMALL_ARG
    done
  done
  for side in base patched; do
    have tq33-$side && run uqcg33_$side 150 $PY ci/gpu/uq_cudagraph.py \
      --tree "$T/tq33-$side" --label $side --out "$OUT/uqcg33_$side.json" $SMALL_ARG
  done
}
part_bench() {
  local v pre x t
  for v in bench:c:tq-patched bench:b:v0.21.0 bench:a:tq-base bench33:c:tq33-patched \
      bench33:b:tq33-base; do
    IFS=: read -r pre x t <<< "$v"
    have "$t" && run "${pre}_$x" 150 $PY ci/gpu/tq_continuation_bench.py --tree "$T/$t" \
      --variant $x --modes "${BENCH_MODES:-sdpa,fa}" --out "$W/${pre}_$x.json" \
      --samples "$W/${pre}_samples_$x.pt" $SMALL_ARG
  done
}
part_store() {  # v0.33.0's slot store beside its SoA store (issue 54's layout)
  run store_bench "${STORE_CAP:-120}" $PY ci/gpu/tq_store_bench.py \
    --tree "$T/tq33-patched" --out "$OUT/store" $SMALL_ARG
  cat "$OUT/store/tq_store_bench.md" 2>/dev/null
}
part_decode() {
  local cap=${DECODE_CAP:-330} sweep=--sweep
  [ "${DECODE_SWEEP:-1}" = 1 ] || sweep=
  run decode_bench "$cap" $PY ci/gpu/tq_decode_bench.py --tree "$T/tq33-patched" \
    --out "$OUT/decode" $sweep --deadline $(( cap - 50 )) $SMALL_ARG \
    ${DECODE_PRESETS:+--presets $DECODE_PRESETS} ${DECODE_CELLS:+--cells $DECODE_CELLS} \
    ${DECODE_PEER:+--peer $DECODE_PEER --errors} ${DECODE_ARGS:-}
  cp "$W/decode_bench.log" "$OUT/decode/" 2>/dev/null
  cat "$OUT/decode/tq_decode_table.md" 2>/dev/null
}
part_accuracy() {  # ACC_BASE: v0.33.0's kernel file where tq33-base is not staged
  local cap=${ACC_CAP:-360} bcap=${ACC_BENCH_CAP:-100} t
  run accuracy "$cap" $PY ci/gpu/tq_decode_accuracy.py --tree "$T/tq33-patched" \
    --base-kernel "$ACC_BASE" \
    --out "$OUT/accuracy" --deadline $(( cap - 60 )) ${ACC_ARGS:-} $SMALL_ARG
  cp "$W/accuracy.log" "$OUT/accuracy/" 2>/dev/null
  for t in ${ACC_BENCH_TREES-tq33-patched}; do
    run "abench_$t" "$bcap" $PY ci/gpu/tq_decode_bench.py --tree "$T/$t" \
      --out "$OUT/accuracy/bench_$t" --deadline $(( bcap - 30 )) $SMALL_ARG \
      --cells "${ACC_BENCH_CELLS:-8x131072,32x131072,128x32768}" \
      --presets "${ACC_BENCH_PRESETS:-4bit_nc,k8v4}"
  done
  cat "$OUT"/accuracy/bench_*/tq_decode_table.md "$OUT/accuracy/tq_decode_accuracy.md" 2>/dev/null
}
part_sinks() {  # the accuracy suite on trained-model data (issue 51): bf16, then fp16
  local r d args v cap more=()
  for v in ${SINK_PREV:+prev=$SINK_PREV} ${SINK_VARIANTS:-}; do more+=(--variant "$v"); done
  for r in ${SINK_RUNS:-bfloat16:bfloat16 float16:float16}; do
    d=${r#*:} args=${SINK_BF16:-}; [ $d = float16 ] && args=${SINK_FP16:-}
    [ -n "${SINK_RUNS:-}" ] && v="SINK_${r%%:*}" && args=${!v:-}
    cap="SINK_CAP_${r%%:*}" && cap=${!cap:-${SINK_CAP:-280}}  # a run's own cap
    run "sinks_${r%%:*}" "$cap" $PY ci/gpu/tq_decode_accuracy.py \
      --tree "$T/tq33-patched" --tree-name patched "${more[@]}" \
      --base-kernel "$ACC_BASE" \
      --out "$OUT/sinks_${r%%:*}" --deadline $(( cap - 40 )) --dtype $d $args $SMALL_ARG
    cat "$OUT/sinks_${r%%:*}/tq_decode_accuracy.md" 2>/dev/null
  done
}
ncu_pages() {  # DIR NAME NCU: NAME.ncu-rep's details page, SASS and opcode mix
  $3 --import "$1/$2.ncu-rep" --page details --print-details all > "$1/$2.txt" 2>&1
  $3 --import "$1/$2.ncu-rep" --page source --print-source sass --csv > "$1/$2.sass.csv" 2>&1
  $PY ci/gpu/ncu_sass_mix.py "$1/$2.sass.csv" 2>&1 | tee "$1/$2.mix.txt"
}
part_profile() {  # ncu's details page and SASS opcode mix into $OUT/profile.tar.gz
  local P=$W/profile ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  mkdir -p "$P"
  if [ -n "${PROF_RUNS:-}" ]; then profile_regs "$P" "$ncu"; else profile_stage1 "$P" "$ncu"; fi
  tar -C "$P" -czf "$OUT/profile.tar.gz" --exclude='*.ncu-rep' .
}
profile_stage1() {  # PRESET:KERNEL: 0009's stage 1 (new), PROF_PEER=.peer: vllm#53060's too
  local P=$1 ncu=$2 p k n
  for p in 4bit_nc:new k8v4:new ${PROF_PEER:+4bit_nc:peer 4bit_nc:peer_mma}; do
    k=${p#*:} n=prof_${p%%:*}
    [ "$k" = new ] || n=prof_$k
    run $n "${PROF_CAP:-120}" $ncu -k "regex:$([ "$k" = new ] && echo _tq_grouped_decode_stage1 ||
      echo '^(tq_)?decode_kernel$')" -s 1 -c 1 --set full \
      --import-source no -f -o "$P/$n" $PY ci/gpu/tq_decode_profile.py \
      --tree "$T/tq33-patched" --preset turboquant_${p%%:*} --cell "${PROF_CELL:-32x32768}" \
      --kernel "$k" ${PROF_PEER:+--peer $PROF_PEER}
    ncu_pages "$P" "$n" "$ncu"
    grep -E "Duration|DRAM Throughput|Registers Per|Theoretical Occupancy|Eligible Warps|Instructions Executed" "$P/$n.txt"
  done
}
profile_regs() {  # PROF_RUNS="NAME:PRESET:D:GQA ...": the registers stage 1
  # as served (the suite's tree variant: SoA pages where the backend stores
  # them; $TQ_SOA_NAME: that module instead of the tree's), its first launch
  local P=$1 ncu=$2 r name pre d g n
  for r in $PROF_RUNS; do
    IFS=: read -r name pre d g <<< "$r"
    n=prof_${name}_${pre}_d${d}_g$g
    run $n "${PROF_CAP:-120}" $ncu -k regex:_tq_grouped_decode_regs_stage1 -s 0 -c 1 \
      --set full --import-source no -f -o "$P/$n" $PY ci/gpu/tq_decode_accuracy.py \
      --tree "$T/tq33-patched" --tree-name "$name" --tree-variant ci/gpu/tq_soa_tree.py \
      --base-kernel "$ACC_BASE" \
      --presets "$pre" --dims "$d" --gqa "$g" --cells "${PROF_CELL:-32x32768}" \
      --sweep none --reps 1 --data sink:small --out "$W/$n" $SMALL_ARG
    ncu_pages "$P" "$n" "$ncu"
    grep -E "Duration|Registers Per|Achieved Occupancy|Eligible Warps|Issued Ipc|Stall|Pipe" "$P/$n.txt"
  done
}
part_upstream() {  # apply.py upstream's comparison, where the GPU tests run
  run upstream "${UP_CAP:-500}" $PY ci/gpu/upstream_tests.py --stack tq-v0.33 \
    --tests-tgz "${UP_TESTS:-.gpu/tests-v0.33.0.tgz}" \
    --base "$T/tq33-base" --patched "$T/tq33-patched"
  cp "$W/upstream.log" "$OUT/" 2>/dev/null
  tail -n 20 "$W/upstream.log"
}
part_engine() {  # one call: its carry applied, then its jobs
  local call=${CALL:?CALL=NAME: the carry .dev/eng/NAME and/or the jobs CALLS[NAME]} rc
  export ENG_ROOT=${ENG_ROOT:-/root/eng} VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_DEEP_GEMM_WARMUP=skip
  export VLLM_ALLOW_INSECURE_SERIALIZATION=1  # collective_rpc(callable) probes
  export TVM_FFI_DISABLE_TORCH_C_DLPACK=1     # xgrammar's tvm-ffi: no torch addon build
  export VLLM_LOGGING_LEVEL=INFO VLLM_CACHE_ROOT=$ENG_ROOT/cache/vllm
  export TRITON_CACHE_DIR=$ENG_ROOT/cache/triton TORCHINDUCTOR_CACHE_DIR=$ENG_ROOT/cache/inductor
  export TORCHINDUCTOR_COMPILE_THREADS=4  # up to 8 engines compile at once
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  { echo "== $call $(date -u +%FT%TZ) $gpu"
    $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  } 2>&1 | tee -a "$OUT/${call}_setup.log"
  $PY ci/gpu/engine/setup.py --carry ".dev/eng/$call" 2>&1 | tee -a "$OUT/${call}_setup.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "setup of $call failed: exit $rc"; exit "$rc"; }
  $PY ci/gpu/engine/driver.py --call "$call" --deadline "$(left)" --out "$OUT" ${JOBS:+--jobs "$JOBS"}
}

if [ "$parts" = engine ]; then part_engine; exit 0; fi
# The import-time dependencies of vLLM the device lacks (.whl), the trees.
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
fi
for f in .gpu/*.tar.gz; do
  [ -e "$f" ] || continue
  n=$(basename "$f" .tar.gz); rm -rf "${T:?}/$n"; mkdir -p "$T/$n"; tar -xf "$f" -C "$T/$n"
done
cp .gpu/MANIFEST "$W/" 2>/dev/null
ls "$T"
for part in ${parts//,/ }; do
  case $part in
    tests|batches|cudagraph|bench|decode|store|accuracy|sinks|profile|upstream) part_$part ;;
    none) ;;
    *) echo "run.sh: no part $part" ;;
  esac
done
$PY ci/gpu/summarize.py --work "$W" --out "$OUT" > "$W/summary.log" 2>&1 || tail -n 30 "$W/summary.log"
tar -C "$W" -czf "$OUT/logs.tar.gz" --exclude='*.pt' . 2>/dev/null
cat "$OUT/tables.md" 2>/dev/null
