"""vllm#53060's decode (tqpeer.py) as a variant of the decode accuracy suite:
``--variant peer=ci/gpu/tq_peer_variant.py`` (issue 54's side-by-side
table). Its sources staged by peer_stage.sh in $TQ_PEER_DIR (.peer), built
when the suite loads this file; a build that fails is printed and the
variant then serves no cell.

The peer decodes turboquant_4bit_nc with bf16 queries at head sizes 64,
128 and 256 (``serves``). It runs its own dispatch (the call its backend
makes, its own split count) on a copy of the suite's cache in its
page-local layout (``tqpeer.to_peer_layout``: bytes moved, no value
changed), so the suite holds it to the same float64 reference as the
others. The workspace and the longest context (its launch plan's input)
are taken on the suite's first, eager call of a cell and reused in the
captured graph.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import tqlib
import tqpeer

CONVERTS_CACHE = True  # the suite's memory: a copy of each cache
OWN_SPLITS = True  # the suite's split count is not the peer's
_PEER: SimpleNamespace | None = None
_CONVERTED: dict = {}
_LAUNCH: dict = {}


def _load() -> SimpleNamespace | None:
    global _PEER
    if _PEER is None and torch.cuda.is_available():
        errors: list = []
        _PEER = tqpeer.try_build(os.environ.get("TQ_PEER_DIR", ".peer"), errors)
    return _PEER


def serves(cfg, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """turboquant_4bit_nc, bf16 queries, D 64/128/256, where the peer built."""
    four = not cfg.key_fp8 and cfg.key_mse_bits == 4
    ok = four and cfg.effective_value_quant_bits == 4 and dtype == torch.bfloat16
    return ok and head_dim in (64, 128, 256) and _load() is not None


def grouped_decode_num_splits(*args, **kwargs) -> int:
    return 1  # the suite's buffers only; the peer plans its own


def _launch(q: torch.Tensor, kv: torch.Tensor, table, seq_lens, block: int):
    """(workspace, longest context) of a cell: read on its eager call."""
    key = (q.shape, table.data_ptr(), seq_lens.data_ptr(), seq_lens._version)
    if key not in _LAUNCH:
        _LAUNCH.clear()
        b, hq, d = q.shape
        length = int(seq_lens.max())
        size = _PEER.ext.workspace_size(
            b, hq, kv.shape[1], table.stride(0), block, d, length, q.device.index or 0
        )
        ws = torch.empty(max(size, 16), dtype=torch.uint8, device=q.device)
        _LAUNCH[key] = (ws, length)
    return _LAUNCH[key]


def triton_turboquant_grouped_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    output_buf: torch.Tensor,
    centroids: torch.Tensor,
    PiT: torch.Tensor,
    **args,
) -> torch.Tensor:
    args["query"] = query
    kv = tqlib.converted_cache(kv_cache, args, tqpeer.to_peer_layout, _CONVERTED)
    block = kv_cache.shape[1]
    ws, length = _launch(query, kv, block_table, seq_lens, block)
    _PEER.ext.run_with_workspace(
        query, kv, block_table, seq_lens, PiT.float().contiguous(),
        centroids.float().contiguous(), ws, output_buf, block, length,
    )  # fmt: skip
    return output_buf
