#!/usr/bin/env bash
# The one command of a GPU run (the device tool's `run`, from the repository
# root, with .gpu and .whl carried; build them here with ci/gpu/pack.sh):
#
#   bash ci/gpu/run.sh [PARTS] [DEADLINE_S]
#
# PARTS: comma list of cudagraph (issue 4), bench (issue 3), tests (targeted
# tests on CUDA), newest (the three on the newest stack, tq-v0.33 on
# v0.33.0: trees tq33-base, tq33-patched), batches (the differential test's
# long mode on both patched stacks), fix (a proposed change,
# ci/gpu/proposed/, benchmarked against (b) and tested), uq (UltraQuant,
# tq-v0.33/0004-0007: uq_cudagraph.py's real full-graph capture and replay on
# tq33-base and tq33-patched, and the UltraQuant tests on tq33-patched),
# decode (issue 28: tq_decode_bench.py with its sweep on tq33-patched, its
# presets from DECODE_PRESETS, e.g. 4bit_nc,k3v4_nc, then the grouped
# decode's tests there; issue 38: DECODE_PEER adds vllm#53060's decode),
# noflash (issue 27: the continuation
# bench without flash-attn on tq33-base and tq33-patched, and the TurboQuant
# tests on tq33-patched), releases (tq-v0.33 on older releases: the tests of
# the patches that apply there, trees tq33-on-<release> from pack.sh's
# PACK_RELEASES), variants (issue 28: stage-1 variants of the grouped
# decode from ci/gpu/variants/, swept side by side), profile (ncu on the
# grouped decode's stage 1), accuracy (issue 35: tq_decode_accuracy.py,
# v0.33.0's decode, 0009's and 0009 + ci/gpu/proposed/*.diff against
# float64, then the bench on both grouped trees); default the first three. DEADLINE_S (default
# 570): every part gets what is left of it, so the summary is always written. Results go to $OUT
# (tq_cudagraph.json, tq_continuation_bench.json, tests.json, tables.md,
# logs.tar.gz, run.log); the summary tables are printed last.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
parts=${1:-cudagraph,bench,tests}
deadline=$(( $(date +%s) + ${2:-570} ))
OUT=${OUT:-/tmp/gpu-out}
W=/tmp/gpuwork
T=/tmp/trees
mkdir -p "$OUT" "$W" "$T"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
PY=${PY:-python3}
left() { echo $(( deadline - $(date +%s) - ${1:-0} )); }
# run NAME CAP CMD...: with a timeout of min(CAP, time left - 25 s)
run() {
  local name=$1 cap=$2; shift 2
  local t; t=$(left 25); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 15 ]; then echo "== $name: not run (deadline)"; echo "$name" >> "$W/not_run"; return; fi
  echo "== $name (timeout ${t}s): $*"
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - s ))s"
  [ $rc -ne 0 ] && tail -n 15 "$W/$name.log"
  echo "$name $rc $(( $(date +%s) - s ))" >> "$W/rc"
  return 0
}

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
# Import-time dependencies of vLLM that the image lacks (wheels in .whl).
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site
for f in .gpu/*.tar.gz .gpu/*.tar.xz; do
  [ -e "$f" ] || continue
  n=$(basename "${f%.tar.*}"); mkdir -p "$T/$n"; tar -xf "$f" -C "$T/$n"
done
cp .gpu/MANIFEST "$W/" 2>/dev/null
ls "$T"

has() { case ",$parts," in *",$1,"*) return 0;; esac; return 1; }
# pt NAME TREE PYTEST-ARGS...: the targeted tests against one tree.
# VLLM_BASE_TREE (tq/0002's bit-exact test): the tree below tq/0002.
# PYTHONPATH: vLLM inspects model classes in a subprocess, which must import
# the same tree.
pt() { local name=$1 tree=$2; shift 2
  run $name ${PT_CAP:-240} env VLLM_TREE=$T/$tree VLLM_BASE_TREE=${BASE_TREE-$T/tq-0001} \
    PYTHONPATH=$T/$tree:/tmp/site $PY -m pytest -q \
    -p no:cacheprovider -o addopts= --junitxml=$W/junit_$name.xml -rfE "$@"; }

if has cudagraph; then
  run cg_base 150 $PY ci/gpu/tq_cudagraph.py --tree $T/tq-base --label base \
    --out $W/cg_base.json --samples $W/cg_samples_base.pt
  run cg_patched 150 $PY ci/gpu/tq_cudagraph.py --tree $T/tq-patched --label patched \
    --out $W/cg_patched.json --samples $W/cg_samples_patched.pt
fi
if has bench; then
  for v in c:tq-patched b:v0.21.0 a:tq-base; do
    run bench_${v%%:*} 150 $PY ci/gpu/tq_continuation_bench.py --tree $T/${v#*:} \
      --variant ${v%%:*} --out $W/bench_${v%%:*}.json --samples $W/samples_${v%%:*}.pt
  done
fi
if has tests; then
  pt tq_patched tq-patched tests/patches/test_tq_workspace.py \
    tests/patches/test_tq_host_metadata.py tests/patches/test_tq_hybrid.py \
    tests/patches/test_tq_grouped_decode.py tests/patches/test_tq_batches.py
  # Each tq patch's regression tests (the first Tests: line) on the base.
  reg=$(for p in $(grep -E '^tq/' series); do
          grep -m1 '^Tests:' "patches/$p" | cut -d' ' -f2-; done)
  pt tq_base_regression tq-base $reg
  pt dsv4_patched dsv4-patched tests/patches/test_dsv4_aiter_scratch.py \
    tests/patches/test_dsv4_compressor_rope.py
  pt dsv4_base dsv4-base tests/patches/test_dsv4_aiter_scratch.py \
    tests/patches/test_dsv4_compressor_rope.py
fi

if has newest; then
  # The newest stack (tq-v0.33 on v0.33.0): capture and timing, the
  # continuation bench (b: the release's own reservation, c: the tiles) and
  # the stack's tests, patched and on the base (regression tests).
  run cg33_base 150 $PY ci/gpu/tq_cudagraph.py --tree $T/tq33-base --label v0.33.0 \
    --out $W/cg33_base.json
  run cg33_patched 150 $PY ci/gpu/tq_cudagraph.py --tree $T/tq33-patched \
    --label tq-v0.33 --out $W/cg33_patched.json
  for v in c:tq33-patched b:tq33-base; do
    run bench33_${v%%:*} 150 $PY ci/gpu/tq_continuation_bench.py --tree $T/${v#*:} \
      --variant ${v%%:*} --out $W/bench33_${v%%:*}.json
  done
  # Each patch's tests (its Tests: lines), as apply.py selects them.
  sel=$(for p in $(grep -E '^tq-v0.33/' series); do
          grep '^Tests:' "patches/$p" | cut -d' ' -f2-; done)
  BASE_TREE= pt tq33_patched tq33-patched $sel
  reg=$(for p in $(grep -E '^tq-v0.33/' series); do
          grep -m1 '^Tests:' "patches/$p" | cut -d' ' -f2-; done)
  BASE_TREE= pt tq33_base_regression tq33-base $reg
fi

if has noflash; then
  # Continuation prefill without vLLM's flash-attn (issue 27, item 1): the
  # bench in sdpa mode only, v0.33.0 (b) and tq-v0.33 (c), as bench33_*.json
  # (the newest stack's tables), then tq-v0.33's TurboQuant tests on CUDA
  # (test_fused_attention_with_lse: PyTorch's FA2 and memory-efficient
  # kernels against float64).
  for v in c:tq33-patched b:tq33-base; do
    run bench33_${v%%:*} 150 $PY ci/gpu/tq_continuation_bench.py --tree $T/${v#*:} \
      --variant ${v%%:*} --modes sdpa --out $W/bench33_${v%%:*}.json
  done
  BASE_TREE= pt nf33_patched tq33-patched tests/patches/test_tq_workspace.py
fi

if has batches; then
  # The differential test of the TurboQuant backend (tests/patches/
  # test_tq_batches.py) in its long mode: the trees' own continuation
  # threshold, contexts up to 300 tokens, TQ_BATCH_EXAMPLES per test.
  for t in tq-patched tq33-patched; do
    BASE_TREE= PT_CAP=300 TQ_BATCH_EXAMPLES=${TQ_BATCH_EXAMPLES:-100} \
      pt batches_${t%-patched} $t tests/patches/test_tq_batches.py
  done
fi

if has fix; then
  # A proposed change (ci/gpu/proposed/, tree tq-fix from pack.sh) against
  # (b) in the same run, on the device as it is (no vLLM flash-attn), and
  # the tq/0001 + tq/0002 tests on it (without the bit-exact test, whose
  # reference tree lacks the change).
  if [ -d $T/tq-fix ]; then
    run bench_f 150 $PY ci/gpu/tq_continuation_bench.py --tree $T/tq-fix \
      --variant c --modes sdpa --out $W/bench_f.json --samples $W/samples_f.pt
    [ -f $W/bench_b.json ] || run bench_b 150 $PY ci/gpu/tq_continuation_bench.py \
      --tree $T/v0.21.0 --variant b --modes sdpa --out $W/bench_b.json --samples $W/samples_b.pt
    run cg_fix 120 $PY ci/gpu/tq_cudagraph.py --tree $T/tq-fix --label fix \
      --modes sdpa --out $W/cg_fix.json
    BASE_TREE= pt tq_fix tq-fix tests/patches/test_tq_workspace.py \
      tests/patches/test_tq_host_metadata.py
  else
    echo "== fix: no .gpu/tq-fix.tar.gz (pack.sh builds it from ci/gpu/proposed/)"
  fi
fi

if has releases; then
  # tq-v0.33 on older releases (pack.sh PACK_RELEASES): each tree's tests,
  # the Tests of the patches that apply there (.gpu/<tree>.tests), on CUDA.
  # RELEASES_CPU=1: on the CPU instead (Triton's interpreter, as CI runs
  # them; the trees of v0.28.0-v0.31.0 import vllm._C_stable_libtorch on
  # CUDA, which a source tree lacks), all trees at once, -v so a tree cut
  # off by the deadline still shows each test it ran.
  pids=()
  for f in .gpu/tq33-on-*.tests; do
    n=$(basename "$f" .tests)
    if [ "${RELEASES_CPU:-0}" = 1 ]; then
      CUDA_VISIBLE_DEVICES= PT_CAP=9999 BASE_TREE= pt "$n" "$n" -v $(cat "$f") &
      pids+=($!)
    else
      PT_CAP=150 BASE_TREE= pt "$n" "$n" $(cat "$f")
    fi
  done
  # Not a bare `wait`: it would wait for the tee of the log as well.
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
fi
if has uq; then
  # UltraQuant (ROCm's backend; its Triton kernels run on CUDA too, FlyDSL
  # does not): a full graph captured on the runner's dummy metadata and
  # replayed with real verification batches, against eager and float64.
  for v in base:tq33-base patched:tq33-patched; do
    run uqcg33_${v%%:*} 150 $PY ci/gpu/uq_cudagraph.py --tree $T/${v#*:} \
      --label ${v%%:*} --out $W/uqcg33_${v%%:*}.json
    cp $W/uqcg33_${v%%:*}.json "$OUT/" 2>/dev/null
  done
  BASE_TREE= pt uq33_patched tq33-patched tests/patches/test_uq_attention.py \
    tests/patches/test_uq_workspace.py tests/patches/test_uq_batches.py
fi

if has decode; then
  # v0.33.0's TurboQuant decode kernel, the grouped one and bf16 FA2 side by
  # side (tables and JSON in $OUT/decode), then the grouped decode's tests
  # and the TurboQuant tests whose decode rows take it.
  # DECODE_PEER=.peer (ci/gpu/peer_stage.sh; carry .peer): vllm#53060's
  # decode built there and timed beside them (4bit_nc), every kernel's
  # error against float64 (--errors); DECODE_SWEEP=0: no sweep;
  # DECODE_TESTS=0: no tests; DECODE_CELLS=BxL,...; DECODE_CAP (330 s).
  cap=${DECODE_CAP:-330}
  sweep=--sweep; [ "${DECODE_SWEEP:-1}" = 1 ] || sweep=
  run decode_bench $cap $PY ci/gpu/tq_decode_bench.py --tree $T/tq33-patched \
    --out "$OUT/decode" $sweep --deadline $(( cap - 50 )) \
    ${DECODE_PRESETS:+--presets $DECODE_PRESETS} ${DECODE_CELLS:+--cells $DECODE_CELLS} \
    ${DECODE_PEER:+--peer $DECODE_PEER --errors}
  mkdir -p "$OUT/decode"; cp $W/decode_bench.log "$OUT/decode/" 2>/dev/null
  # (without tq/0002's test of a builder given no CPU seq_lens at all: tq-v0.33
  # leaves that to upstream, whose runner and unpadded() always pass the bound)
  [ "${DECODE_TESTS:-1}" = 1 ] && BASE_TREE= pt tq33_decode tq33-patched \
    tests/patches/test_tq_grouped_decode.py \
    tests/patches/test_tq_batches.py tests/patches/test_tq_host_metadata.py \
    --deselect tests/patches/test_tq_host_metadata.py::test_builder_without_cpu_seq_lens
  cat "$OUT/decode/tq_decode_table.md" 2>/dev/null
fi

if has accuracy; then
  # issue 35: v0.33.0's decode kernel, 0009's grouped one and 0009 + each
  # proposal (ci/gpu/proposed/*.diff against tq33-patched's kernel file,
  # tree tq33-fix) against float64 in one process (ACC_ARGS: shapes, cells;
  # ACC_BASE: v0.33.0's kernel file when tq33-base is not carried), then
  # tq_decode_bench.py on tq33-patched and tq33-fix at ACC_BENCH_CELLS.
  GD=vllm/v1/attention/ops/triton_turboquant_grouped_decode.py
  rm -rf "${T:?}/tq33-fix"; cp -a $T/tq33-patched $T/tq33-fix
  vargs=""
  for d in ci/gpu/proposed/*.diff; do
    [ -e "$d" ] || continue
    patch -d $T/tq33-fix -p1 -s -N < "$d" && vargs="--variant fixed=$T/tq33-fix/$GD" \
      || echo "== accuracy: $d does not apply"
  done
  # ACC_VARIANTS: ci/gpu/variants/NAME.diff each beside them (tree tq33-var-NAME)
  for v in ${ACC_VARIANTS:-}; do
    rm -rf "${T:?}/tq33-var-$v"; cp -a $T/tq33-patched $T/tq33-var-$v
    patch -d $T/tq33-var-$v -p1 -s < ci/gpu/variants/$v.diff \
      && vargs="$vargs --variant $v=$T/tq33-var-$v/$GD" || echo "== accuracy: $v does not apply"
  done
  cap=${ACC_CAP:-360}
  run accuracy $cap $PY ci/gpu/tq_decode_accuracy.py --tree $T/tq33-patched \
    --base-kernel "${ACC_BASE:-$T/tq33-base/vllm/v1/attention/ops/triton_turboquant_decode.py}" \
    $vargs --out "$OUT/accuracy" --deadline $(( cap - 60 )) ${ACC_ARGS:-}
  cp $W/accuracy.log "$OUT/accuracy/" 2>/dev/null
  for t in ${ACC_BENCH_TREES-tq33-patched tq33-fix}; do
    run abench_$t ${ACC_BENCH_CAP:-100} $PY ci/gpu/tq_decode_bench.py --tree $T/$t \
      --out "$OUT/accuracy/bench_$t" --deadline $(( ${ACC_BENCH_CAP:-100} - 30 )) \
      --cells "${ACC_BENCH_CELLS:-8x131072,32x131072,128x32768}" \
      --presets "${ACC_BENCH_PRESETS:-4bit_nc,k8v4}"
    cp $W/abench_$t.log "$OUT/accuracy/" 2>/dev/null
  done
  cat "$OUT"/accuracy/bench_*/tq_decode_table.md "$OUT/accuracy/tq_decode_accuracy.md" 2>/dev/null
fi

if has variants; then
  # Stage-1 variants of the grouped decode: ci/gpu/variants/NAME.diff against
  # tq33-patched's module (as of cad39a5: stacked, tlgather, transposed and
  # words do not apply to the later, 3-bit-aware one); VARIANTS lists them ("stacked+reg168": both, in
  # order; default every diff alone). Tree tq33-var-NAME each; every tree,
  # tq33-patched first, gets the bench's sweep on VAR_CELLS (its own v0.33.0
  # and FA2 columns, same GPU).
  vtrees=""
  for v in ${VARIANTS:-$(cd ci/gpu/variants && ls *.diff | sed 's/\.diff$//')}; do
    n=tq33-var-$v; rm -rf "${T:?}/$n"; cp -a $T/tq33-patched $T/$n
    for d in ${v//+/ }; do
      patch -d $T/$n -p1 -s < ci/gpu/variants/$d.diff || { echo "== $v: $d does not apply"; continue 2; }
    done
    vtrees="$vtrees $n"
  done
  for t in tq33-patched $vtrees; do
    run vbench_$t ${VAR_CAP:-170} $PY ci/gpu/tq_decode_bench.py --tree $T/$t \
      --out "$W/variants/$t" --sweep --deadline $(( ${VAR_CAP:-170} - 15 )) \
      --cells "${VAR_CELLS:-1x131072,8x32768,32x32768,32x131072,128x32768}" \
      --kernels "${VAR_KERNELS:-64,4,1;64,8,1;32,4,1;128,8,1;32,4,2;64,8,2}" \
      --ppsm "${VAR_PPSM:-8}"
    echo "## $t"; cat "$W/variants/$t/tq_decode_table.md" 2>/dev/null
  done
fi

if has profile; then
  # ncu on one grouped-decode stage 1 per preset (PROF_TREES, default
  # tq33-patched; PROF_CELL 32x32768): the full set; its details page and
  # its per-SASS-instruction source page (CSV) in $OUT/profile.tar.gz, the
  # details page printed in part.
  P=$W/profile; mkdir -p "$P"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for t in ${PROF_TREES:-tq33-patched}; do
    for p in turboquant_4bit_nc turboquant_k8v4; do
      n=prof_${t}_${p#turboquant_}
      run $n ${PROF_CAP:-120} $NCU -k regex:_tq_grouped_decode_stage1 -s 1 -c 1 \
        --set full --import-source no -f -o "$P/$n" \
        $PY ci/gpu/tq_decode_profile.py --tree $T/$t --preset $p \
        --cell "${PROF_CELL:-32x32768}"
      $NCU --import "$P/$n.ncu-rep" --page details --print-details all > "$P/$n.txt" 2>&1
      $NCU --import "$P/$n.ncu-rep" --page source --print-source sass --csv \
        > "$P/$n.sass.csv" 2>&1
      $PY ci/gpu/ncu_sass_mix.py "$P/$n.sass.csv" > "$P/$n.mix.txt" 2>&1
      cat "$P/$n.mix.txt"
      grep -E "Duration|DRAM Throughput|Registers Per|Theoretical Occupancy|Issue Slots Busy|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Instructions Executed|Stall (Wait|Long|Short|Barrier|MIO|Math)" \
        "$P/$n.txt" | head -24
    done
  done
  tar -C "$P" -czf "$OUT/profile.tar.gz" --exclude='*.ncu-rep' .
fi

$PY ci/gpu/summarize.py --work "$W" --out "$OUT" > "$W/summary.log" 2>&1 || tail -n 30 "$W/summary.log"
tar -C "$W" -czf "$OUT/logs.tar.gz" --exclude='*.pt' . 2>/dev/null
cat "$OUT/tables.md" 2>/dev/null
