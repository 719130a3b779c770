#!/usr/bin/env bash
# Deterministic export of one commit as a patch file of this series.
# Usage: ci/format-patch.sh REPO REV > patches/<stack>/NNNN-name.patch
set -euo pipefail
repo=$1 rev=${2:-HEAD}
exec git -C "$repo" -c core.abbrev=12 -c diff.noprefix=false \
  -c diff.mnemonicPrefix=false -c diff.renames=false -c diff.algorithm=myers \
  -c diff.indentHeuristic=true -c format.signature= -c format.headers= \
  -c format.numbered=false -c format.coverLetter=false -c format.signOff=false \
  -c format.thread=false format-patch -1 --stdout --zero-commit --full-index \
  --no-signature --keep-subject --no-renames --no-numbered --stat=72 \
  --encode-email-headers --no-attach --no-thread --no-to --no-cc "$rev"
