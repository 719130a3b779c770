#!/usr/bin/env bash
# Stage the peer's decode sources (vllm#53060: xupinjie/vllm, branch
# pinjie/turboquant_opt_v2, commit ae702ab8d) into .peer/ (ignored, never
# tracked), for the device's `decode` part (DECODE_PEER=.peer; carry
# ".peer"). The peer's code is read from a local mirror with `git show`;
# nothing of it is copied into tracked files.
#
#   bash ci/gpu/peer_stage.sh [GIT_DIR] [COMMIT]
#
# Defaults: /work/.mirror/xupinjie+vllm/repo, ae702ab8d. .peer/SOURCE
# records the full commit and each file's sha256.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
git_dir=${1:-${PEER_GIT:-/work/.mirror/xupinjie+vllm/repo}}
commit=${2:-ae702ab8d}
out=$root/.peer
rm -rf "$out"; mkdir -p "$out"
full=$(git -C "$git_dir" rev-parse --verify "$commit^{commit}")
echo "vllm#53060 xupinjie/vllm pinjie/turboquant_opt_v2 $full" > "$out/SOURCE"
for f in main.cpp kernel.cu kernel.h mma_kernel.cu; do
  git -C "$git_dir" show "$full:csrc/attention/turboquant/$f" > "$out/$f"
  echo "$f $(sha256sum "$out/$f" | cut -c1-16)" >> "$out/SOURCE"
done
cat "$out/SOURCE"
