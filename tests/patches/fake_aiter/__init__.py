"""A stand-in for AMD AITER's persistent-mode sparse MLA decode (test code).

AITER runs only on ROCm GPUs, and the PyPI package named ``aiter`` is an
unrelated project, so the DeepSeek-V4 tests install this package as
``aiter`` (``sys.modules``, inside a fixture). It offers what
``vllm/v1/attention/ops/rocm_aiter_dsv4_decode.py`` calls, with AITER's
documented signatures and contract:

* ``get_mla_metadata_info_v1`` returns ``(shape, dtype)`` of the six
  persistent-mode buffers, from shapes only.
* ``get_mla_metadata_v1`` writes a work plan into those buffers, derived
  from the given indptrs: every batch row's kv range is cut into splits of
  ``kv_granularity``, the works are dealt to ``CU_NUM`` compute units
  (``work_indptr``), split rows are merged through the reduce maps.
  ``work_metadata_ptrs`` holds the addresses of ``work_indptr`` and
  ``work_info_set``, as in AITER.
* ``mla.mla_decode_fwd`` checks the plan against the ``kv_indptr`` it is
  given, as the real persistent kernel implicitly does by trusting it: a
  plan written for other kv lengths is a *stale work plan*, and the fake
  faults (``torch._assert_async``: a ``RuntimeError`` on CPU, a device-side
  assert on a GPU, like the memory-access fault of the real kernel). Else it
  computes sparse MLA decode with LSE from the FP8 inputs, in float32, split
  by split as planned, and writes ``o`` in place.

Everything is written with tensor ops and no host synchronisation, so a CUDA
graph can capture the fake (the GPU tests do).
"""

from __future__ import annotations

from collections import Counter

import torch

from . import mla

__all__ = ["CU_NUM", "calls", "get_mla_metadata_info_v1", "get_mla_metadata_v1", "mla"]

# Compute units ("cu parts") the fake deals works to; small, so that plans of
# tiny test batches still have split rows and a non-trivial reduce.
CU_NUM = 4

# Calls per entry point; tests reset it.
calls: Counter[str] = Counter()


def get_mla_metadata_info_v1(
    batch_size: int,
    max_seqlen_qo: int,
    num_head_qo: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    is_sparse: bool,
    fast_mode: bool = True,
    num_kv_splits: int = 32,
    intra_batch_mode: bool = False,
    max_split_per_batch: int = -1,
):
    """Sizes of the persistent-mode buffers, as AITER returns them:
    work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr,
    reduce_final_map, reduce_partial_map, each as (shape, dtype).

    Sized like AITER's non-fast mode (``tile_cnt * max_splits`` works and
    partials), a bound for any plan this fake writes.
    """
    calls["get_mla_metadata_info_v1"] += 1
    assert num_head_qo % 8 == 0
    assert not intra_batch_mode, "the fake implements persistent mode only"
    # One qo tile per (sparse: per token) batch row, as for 16..128 heads.
    assert num_head_qo * (1 if is_sparse else max_seqlen_qo) <= 128
    tile_cnt = batch_size * max_seqlen_qo if is_sparse else batch_size
    max_work = tile_cnt * CU_NUM
    return (
        ((2), torch.uint64),  # work_metadata_ptrs
        ((CU_NUM + 1), torch.int32),  # work_indptr
        ((max_work, 8), torch.int32),  # work_info_set
        ((tile_cnt + 1), torch.int32),  # reduce_indptr
        ((tile_cnt, 2), torch.int32),  # reduce_final_map
        (max_work, torch.int32),  # reduce_partial_map
    )


def get_mla_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_heads_per_head_k: int,
    num_heads_k: int,
    is_causal: bool,
    work_metadata_ptrs: torch.Tensor,
    work_info_set: torch.Tensor,
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    page_size: int = 1,
    kv_granularity: int = 16,
    max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1,
    fast_mode: bool = True,
    topk: int = -1,
    max_split_per_batch: int = -1,
    intra_batch_mode: bool = False,
    dtype_q: torch.dtype | None = None,
    dtype_kv: torch.dtype | None = None,
) -> None:
    """Write the work plan for these indptrs into the given buffers.

    work_info_set rows (AITER's layout): bs_index, partial_index (-1: not
    split), q_start, q_end, kv_start, kv_end (positions in kv_indices; for
    sparse attention row ``b`` starts at ``b * topk``), kv_offset (unused),
    q heads (low/high 16 bits).
    """
    calls["get_mla_metadata_v1"] += 1
    assert page_size == 1 and not intra_batch_mode
    dev = seqlens_kv_indptr.device
    i64 = torch.int64
    bs = seqlens_qo_indptr.numel() - 1
    n_cu = work_indptr.numel() - 1
    max_splits = work_info_set.shape[0] // bs
    assert max_splits >= 1 and reduce_final_map.shape[0] >= bs

    qo = seqlens_qo_indptr.to(i64)
    kv_len = (seqlens_kv_indptr[1:] - seqlens_kv_indptr[:-1]).to(i64)
    n_split = torch.clamp((kv_len + kv_granularity - 1) // kv_granularity, 1)
    n_split = n_split.clamp(max=max_splits)
    if max_split_per_batch > 0:
        n_split = n_split.clamp(max=max_split_per_batch)
    chunk = (kv_len + n_split - 1) // n_split

    s = torch.arange(max_splits, device=dev)
    valid = s[None, :] < n_split[:, None]  # (bs, max_splits)
    lo = torch.minimum(s[None, :] * chunk[:, None], kv_len[:, None])
    hi = torch.minimum(lo + chunk[:, None], kv_len[:, None])
    if topk > 0:  # sparse: fixed-stride kv_indices, topk slots per row
        base = torch.arange(bs, device=dev, dtype=i64) * topk
    else:
        base = seqlens_kv_indptr[:-1].to(i64)
    split = valid & (n_split > 1)[:, None]
    partial = torch.where(split, split.flatten().cumsum(0).view(bs, -1) - 1, -1)
    b_idx = torch.arange(bs, device=dev, dtype=i64)[:, None].expand_as(lo)
    heads = num_heads_per_head_k * num_heads_k << 16
    rows = torch.stack(
        [
            b_idx,
            partial,
            qo[:-1, None].expand_as(lo),
            qo[1:, None].expand_as(lo),
            base[:, None] + lo,
            base[:, None] + hi,
            torch.zeros_like(lo),
            torch.full_like(lo, heads),
        ],
        dim=-1,
    ).view(-1, 8)

    # Deal the works, in (batch, split) order, round-robin to the CUs; the
    # rows of CU c are work_info_set[work_indptr[c]:work_indptr[c + 1]].
    flat_valid = valid.flatten()
    wid = flat_valid.cumsum(0) - 1
    n_work = flat_valid.sum()
    cu = torch.arange(n_cu, device=dev)
    per_cu = ((n_work - cu + n_cu - 1) // n_cu).clamp(min=0)
    first = per_cu.cumsum(0) - per_cu
    dest = torch.where(
        flat_valid,
        first[wid.clamp(min=0) % n_cu] + wid.clamp(min=0) // n_cu,
        n_work + (~flat_valid).cumsum(0) - 1,
    )
    work_info_set[: rows.shape[0]].index_copy_(0, dest, rows.to(torch.int32))
    work_indptr[:1].zero_()
    work_indptr[1:].copy_(per_cu.cumsum(0))

    # One reduce tile per batch row; split rows list their partial slots.
    n_red = torch.where(n_split > 1, n_split, 0)
    reduce_indptr[:1].zero_()
    reduce_indptr[1 : bs + 1].copy_(n_red.cumsum(0))
    reduce_final_map[:bs, 0].copy_(qo[:-1])
    reduce_final_map[:bs, 1].copy_(qo[1:])
    reduce_partial_map.copy_(
        torch.arange(reduce_partial_map.numel(), device=dev, dtype=torch.int32)
    )

    ptrs = work_metadata_ptrs.view(i64)
    ptrs[0].fill_(work_indptr.data_ptr())
    ptrs[1].fill_(work_info_set.data_ptr())
