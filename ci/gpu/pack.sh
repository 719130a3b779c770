#!/usr/bin/env bash
# Build the vLLM source trees the GPU run (ci/gpu/run.sh) needs, as
# .gpu/<name>.tar.gz (each holds vllm/ only; no compiled extensions), plus
# .gpu/MANIFEST naming what each was made from. Run here, before the `run`
# tool's call that names .gpu and .whl in `carry`.
#
#   tq-base      v0.20.2 release sources (the tq stack's pin)
#   v0.21.0      v0.21.0 release sources (workspace-manager full-dequant path)
#   tq-0001      v0.20.2 + tq/0001 only (VLLM_BASE_TREE of tq/0002's tests)
#   tq-patched   v0.20.2 + the tq patches of ./series, applied with git apply
#                (the current files: refs/heads/patched/tq/v0.20.2 can lag)
#   tq-fix       tq-patched + ci/gpu/proposed/*.diff (proposals, not in the
#                series; only with PACK_FIX=1)
#   tq33-base    v0.33.0 release sources (the tq-v0.33 stack's pin)
#   tq33-patched v0.33.0 + the tq-v0.33 patches of ./series
#   dsv4-base    the dsv4 base, assembled by apply.py from v0.20.0 and the
#                pinned files ($VLLM_PATCHES_FETCHED)
#   dsv4-patched dsv4-base + the dsv4 patches of ./series
#
# Env: VLLM_PATCHES_CACHE (default ~/.cache/vllm-patches), VLLM_PATCHES_FETCHED
# (default ../shared/fixtures/dsv4 beside the project). A tree whose source is
# missing is left out with a note (run.sh parts that need it fail).
# With --extract DIR the trees are also unpacked to DIR/<name>/ (CPU checks).
# PACK_ONLY="tq-fix v0.21.0" keeps only those archives in .gpu/ (a smaller
# carry for a follow-up run; the carry limit is 64 MiB with .whl).
# PACK_RELEASES="v0.28.0 v0.29.0" adds tq33-on-<release>: the release with
# every tq-v0.33 patch that applies there (git apply, in series order; the
# others skipped), xz-compressed, and <tree>.tests: the Tests of the applied
# patches (run.sh part `releases`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${VLLM_PATCHES_CACHE:-$HOME/.cache/vllm-patches}/vllm.git
fetched=${VLLM_PATCHES_FETCHED:-$root/../shared/fixtures/dsv4}
extract=""
[ "${1:-}" = "--extract" ] && extract=$(realpath -m "$2")
out=$root/.gpu
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -f "$out"/*.tar.gz
: > "$out/MANIFEST"

pack() {  # name dir-holding-vllm note [ext: tar.gz (default) or tar.xz]
  # Python and data only: the Rust frontend binary and C++/CUDA sources of
  # later releases (v0.33.0: 120 MB) are never loaded from a source tree.
  local ext=${4:-tar.gz}
  tar -C "$2" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    --exclude=__pycache__ --exclude=vllm/vllm-rs --exclude='*.h' \
    --exclude='*.hpp' --exclude='*.cuh' --exclude='*.cu' --exclude='*.cpp' \
    --exclude='*.inl' --exclude='*.js' -caf "$out/$1.$ext" vllm
  echo "$1.$ext $(du -k "$out/$1.$ext" | cut -f1) KiB: $3" | tee -a "$out/MANIFEST"
  if [ -n "$extract" ]; then
    rm -rf "${extract:?}/$1"; mkdir -p "$extract/$1"; cp -a "$2/vllm" "$extract/$1/"
  fi
}
export_ref() {  # git-dir ref dest
  mkdir -p "$3"; git --git-dir "$1" archive "$2" vllm | tar -x -C "$3"
}
overlay() {  # from-tree new-tree folder ext: from + ci/gpu/<folder>/*.<ext>
  cp -a "$work/$1" "$work/$2"
  for d in "$here/$3"/*."$4"; do
    (cd "$work/$2" && git apply -p1 "$d")
    echo "  + $3 $(basename "$d") sha256=$(sha256sum "$d" | cut -c1-16)" >> "$out/MANIFEST"
  done
  pack "$2" "$work/$2" "$1 + ci/gpu/$3/*.$4 (not in the series)"
}
apply_stack() {  # stack dest
  local p
  for p in $(grep -E "^$1/" "$root/series"); do
    (cd "$2" && git apply -p1 "$root/patches/$p") || { echo "pack.sh: $p does not apply" >&2; exit 2; }
    echo "  + $p sha256=$(sha256sum "$root/patches/$p" | cut -c1-16)" >> "$out/MANIFEST"
  done
}
release_tree() {  # release: tq33-on-<release> and its .tests
  local p n=tq33-on-$1 tests=""
  export_ref "$cache" "$1" "$work/$n"
  for p in $(grep -E "^tq-v0.33/" "$root/series"); do
    if (cd "$work/$n" && git apply -p1 "$root/patches/$p" 2>/dev/null); then
      echo "  + $p" >> "$out/MANIFEST"
      tests="$tests $(sed -n 's/^Tests: //p' "$root/patches/$p" | tr '\n' ' ')"
    else
      echo "  - $p (does not apply on $1)" >> "$out/MANIFEST"
    fi
  done
  echo "$tests" | tr ' ' '\n' | grep . | sort -u > "$out/$n.tests"
  pack "$n" "$work/$n" "$1 + the tq-v0.33 patches that apply (git apply)" tar.xz
}

if [ -d "$cache" ]; then
  for ref in v0.20.2 v0.21.0; do
    export_ref "$cache" "$ref" "$work/$ref"
  done
  pack tq-base "$work/v0.20.2" "$cache tag v0.20.2 $(git --git-dir "$cache" rev-parse v0.20.2)"
  pack v0.21.0 "$work/v0.21.0" "$cache tag v0.21.0 $(git --git-dir "$cache" rev-parse v0.21.0)"
  # v0.20.2 + tq/0001 alone: the tree below tq/0002, for its bit-exact
  # equivalence test (VLLM_BASE_TREE).
  export_ref "$cache" v0.20.2 "$work/tq-0001"
  p1=$(grep -m1 -E '^tq/' "$root/series")
  (cd "$work/tq-0001" && git apply -p1 "$root/patches/$p1")
  pack tq-0001 "$work/tq-0001" "v0.20.2 + $p1 (git apply)"
  export_ref "$cache" v0.20.2 "$work/tq-patched"
  apply_stack tq "$work/tq-patched"
  pack tq-patched "$work/tq-patched" "v0.20.2 + series tq patches (git apply)"
  # Proposed changes (ci/gpu/proposed/*.diff, not in the series) on top of
  # the patched tree, for run.sh's `fix` part; only with PACK_FIX=1.
  if [ "${PACK_FIX:-0}" = 1 ] && ls "$here"/proposed/*.diff >/dev/null 2>&1; then
    overlay tq-patched tq-fix proposed diff
  fi
  if git --git-dir "$cache" rev-parse -q --verify v0.33.0 >/dev/null; then
    export_ref "$cache" v0.33.0 "$work/tq33-base"
    pack tq33-base "$work/tq33-base" "$cache tag v0.33.0 $(git --git-dir "$cache" rev-parse v0.33.0)"
    export_ref "$cache" v0.33.0 "$work/tq33-patched"
    apply_stack tq-v0.33 "$work/tq33-patched"
    pack tq33-patched "$work/tq33-patched" "v0.33.0 + series tq-v0.33 patches (git apply)"
    for rel in ${PACK_RELEASES:-}; do release_tree "$rel"; done
  else
    echo "pack.sh: no v0.33.0 in $cache (apply.py --stack tq-v0.33 fills it); tq33 trees left out" | tee -a "$out/MANIFEST"
  fi
else
  echo "pack.sh: no $cache (run apply.py once to fill it); tq trees left out" | tee -a "$out/MANIFEST"
fi

# "REV COMMIT repo=PATH source=fetched ..." (apply.py base)
dsv4=""
[ -d "$fetched" ] && dsv4=$(VLLM_PATCHES_FETCHED=$fetched python3 "$root/apply.py" \
  base --stack dsv4 --offline 2>/dev/null) || dsv4=""
if [ -n "$dsv4" ]; then
  set -- $dsv4
  dsv4_git=${3#repo=}
  export_ref "$dsv4_git" "$2" "$work/dsv4-base"
  pack dsv4-base "$work/dsv4-base" "$1 $2 (apply.py base --stack dsv4, fetched $fetched)"
  export_ref "$dsv4_git" "$2" "$work/dsv4-patched"
  apply_stack dsv4 "$work/dsv4-patched"
  pack dsv4-patched "$work/dsv4-patched" "dsv4 base + series dsv4 patches (git apply)"
else
  echo "pack.sh: no dsv4 base (apply.py base --stack dsv4 with the pinned files in $fetched); dsv4 trees left out" | tee -a "$out/MANIFEST"
fi
if [ -n "${PACK_ONLY:-}" ]; then
  for f in "$out"/*.tar.*; do
    case " $PACK_ONLY " in *" $(basename "${f%.tar.*}") "*) ;; *) rm -f "$f";; esac
  done
fi
du -ch "$out"/*.tar.* | tail -1
