#!/usr/bin/env bash
# Deterministic export of one commit as a patch file of this series.
# Usage: ci/format-patch.sh REPO REV > patches/<stack>/NNNN-name.patch
exec python3 "$(dirname "$0")/../apply.py" format-patch --repo "$1" "${2:-HEAD}"
