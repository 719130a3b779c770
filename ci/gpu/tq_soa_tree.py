"""The tree's grouped decode on the pages its backend stores (tq-v0.33/0011),
as a variant of the decode accuracy suite:
``--variant 0011=ci/gpu/tq_soa_tree.py``.

The suite writes its caches as slots and runs the tree's launcher on them
(0010's path: slots are what the launcher reads by default). Where the
patched backend stores turboquant_soa's pages
(``grouped_decode_soa_pages``: 4-bit values with FP8 or 4-bit keys; from
0017 with 3-bit keys too), this variant runs the same launcher with
``soa_layout=True`` on a copy of the cache in that layout
(``tqharness.as_soa``: each slot record's bytes moved, no value changed);
the other presets stay on the suite's slots, as the backend keeps them. So both are held to the same float64 reference in one
process, beside v0.33.0's kernel. (Before 2026-12-03 17:00Z it converted every
preset's cache: results/soa-pages-2026-12-03/call1's 3-bit rows.)

As ``--variant NAME=ci/gpu/tq_soa_tree.py`` with $TQ_SOA_NAME set to a grouped
decode module file (a previous patch's), that module's decode on the same
pages instead of the tree's (``configure``).
"""

from __future__ import annotations

import os

import torch
import tqharness as h
import tqlib
import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

_config = gd._config
grouped_decode_num_splits = gd.grouped_decode_num_splits
grouped_decode_in_registers = gd.grouped_decode_in_registers
CONVERTS_CACHE = True  # the suite's memory: a copy of each cache
_CONVERTED: dict = {}


def configure(name: str) -> None:
    """The suite's hook for ``--variant NAME=...``: the module file
    $TQ_SOA_NAME's grouped decode, where set, instead of the tree's."""
    global gd, _config, grouped_decode_num_splits, grouped_decode_in_registers
    path = os.environ.get(f"TQ_SOA_{name}")
    if path:
        gd = tqlib.load_module(f"tq_soa_tree_{name}", path)
        _config = gd._config
        grouped_decode_num_splits = gd.grouped_decode_num_splits
        grouped_decode_in_registers = gd.grouped_decode_in_registers


def triton_turboquant_grouped_decode_attention(
    kv_cache: torch.Tensor, **args
) -> torch.Tensor:
    fp8, vbits = args.get("key_fp8", False), args["value_quant_bits"]
    if not gd.grouped_decode_soa_pages(fp8, args["mse_bits"], vbits):
        return gd.triton_turboquant_grouped_decode_attention(kv_cache=kv_cache, **args)
    return gd.triton_turboquant_grouped_decode_attention(
        kv_cache=tqlib.converted_cache(kv_cache, args, h.as_soa, _CONVERTED),
        soa_layout=True,
        **args,
    )
