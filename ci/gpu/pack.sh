#!/usr/bin/env bash
# The old name of `python3 ci/gpu/stage.py trees` (the one staging script):
# PACK_ONLY="NAME ..." keeps those trees, PACK_RELEASES="vX.Y.Z ..." adds tq33-on-*.
exec python3 "$(dirname "$0")/stage.py" trees ${PACK_ONLY:-} \
  ${PACK_RELEASES:+--releases ${PACK_RELEASES// /,}}
