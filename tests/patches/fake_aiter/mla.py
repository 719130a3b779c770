"""``aiter.mla`` of the fake AITER: the persistent-mode decode entry point."""

from __future__ import annotations

import torch

STALE_PLAN = "stale work plan"


def _fault(ok: torch.Tensor, what: str) -> None:
    # A device-side check, so that a CUDA graph can capture it: RuntimeError
    # on CPU, device-side assert (a dead context, as after the real kernel's
    # memory-access fault) on a GPU.
    torch._assert_async(ok, f"Memory access fault by GPU (fake AITER): {what}")


def mla_decode_fwd(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    page_size: int = 1,
    nhead_kv: int = 1,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    num_kv_splits_indptr: torch.Tensor | None = None,
    work_meta_data: torch.Tensor | None = None,
    work_indptr: torch.Tensor | None = None,
    work_info_set: torch.Tensor | None = None,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    intra_batch_mode: bool = False,
    return_logits: bool = False,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Persistent-mode sparse MLA decode; writes ``o``, returns (logits, lse).

    q: (total_q, nhead, d_qk) fp8; kv_buffer: (num_page, page_size, nhead_kv,
    d_qk) fp8; o: (total_q, nhead, d_v), V being the first d_v features of
    kv_buffer; kv_indices: fixed-stride, ``kv_indices.numel() // batch``
    slots per batch row, ``kv_indptr`` counting the valid leading ones.
    """
    from . import calls

    calls["mla_decode_fwd"] += 1
    assert work_meta_data is not None, "the fake implements persistent mode only"
    assert work_indptr is not None and work_info_set is not None
    assert reduce_indptr is not None and reduce_final_map is not None
    assert reduce_partial_map is not None
    # gfx950 persistent kernels returning LSE exist for FP8/FP8 only.
    assert q.dtype == kv_buffer.dtype == torch.float8_e4m3fn
    assert logit_cap <= 0 and not intra_batch_mode
    assert max_seqlen_q == 1 and page_size == 1 and nhead_kv == 1
    assert kv_buffer.dim() == 4 and kv_buffer.shape[1:3] == (1, 1)

    dev = q.device
    i64 = torch.int64
    total_s, nhead, d_v = o.shape
    d_qk = q.shape[-1]
    bs = qo_indptr.numel() - 1
    num_tokens = kv_buffer.shape[0]
    assert kv_indices.numel() % bs == 0
    stride = kv_indices.numel() // bs
    if sm_scale is None:
        sm_scale = d_qk**-0.5

    # ---- Is the plan the one for this kv_indptr? ------------------------ #
    ptrs = work_meta_data.view(i64)
    ok = (ptrs[0] == work_indptr.data_ptr()) & (ptrs[1] == work_info_set.data_ptr())
    ok &= work_indptr[0] == 0
    info = work_info_set.to(i64)
    cap = info.shape[0]
    live = torch.arange(cap, device=dev) < work_indptr[-1].to(i64)
    b, part, qs, qe, ks, ke = (info[:, c] for c in range(6))
    kv_len = (kv_indptr[1:] - kv_indptr[:-1]).to(i64)
    bb = b.clamp(0, bs - 1)
    row_start = bb * stride
    in_row = (
        (b >= 0)
        & (b < bs)
        & (qs == qo_indptr[bb].to(i64))
        & (qe == qs + 1)
        & (ks >= row_start)
        & (ks <= ke)
        & (ke <= row_start + kv_len[bb])
    )
    ok &= (in_row | ~live).all()
    zero = torch.zeros(bs + 1, dtype=i64, device=dev)
    dump = torch.where(live, bb, bs)
    covered = zero.index_add(0, dump, ke - ks)[:bs]
    n_works = zero.index_add(0, dump, torch.ones_like(b))[:bs]
    ok &= ((covered == kv_len) & (n_works >= 1) & (kv_len <= stride)).all()
    # Split rows must be listed in the reduce maps, unsplit ones not.
    n_red = (reduce_indptr[1 : bs + 1] - reduce_indptr[:bs]).to(i64)
    ok &= (n_red == torch.where(n_works > 1, n_works, 0)).all()
    ok &= (reduce_final_map[:bs, 0].to(i64) == qo_indptr[:-1].to(i64)).all()
    _fault(ok, f"{STALE_PLAN}: work_info_set/reduce maps do not match kv_indptr")

    # ---- Gather each work's kv and attend ------------------------------ #
    j = torch.arange(stride, device=dev)
    span = torch.where(live, ke - ks, 0)
    m = j[None, :] < span[:, None]  # (cap, stride)
    pos = (ks[:, None] + j[None, :]).clamp(0, kv_indices.numel() - 1)
    idx = kv_indices.view(-1)[pos].to(i64)
    _fault(
        (~m | ((idx >= 0) & (idx < num_tokens))).all(),
        "kv_indices entry out of range inside a work's kv span",
    )
    kv = kv_buffer.view(num_tokens, d_qk).float()
    if kv_scale is not None:
        kv = kv * kv_scale.float()
    qf = q.float()
    if q_scale is not None:
        qf = qf * q_scale.float()
    k = kv[idx.clamp(0, num_tokens - 1)]  # (cap, stride, d_qk)
    qr = qf[qs.clamp(0, total_s - 1)]  # (cap, nhead, d_qk)
    s = torch.einsum("rhd,rjd->rhj", qr, k) * sm_scale
    s = s.masked_fill(~m[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (cap, nhead); -inf for empty works
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("rhj,rjd->rhd", p, k[..., :d_v])

    # ---- Unsplit works write o directly; split ones go through reduce --- #
    o_acc = torch.zeros(total_s + 1, nhead, d_v, device=dev)
    lse_acc = torch.full((total_s + 1, nhead), float("-inf"), device=dev)
    direct = torch.where(live & (part < 0), qs.clamp(0, total_s - 1), total_s)
    o_acc.index_put_((direct,), out)
    lse_acc.index_put_((direct,), lse)

    n_part = reduce_partial_map.numel()
    logits = torch.zeros(n_part + 1, nhead, d_v, device=dev)
    attn_lse = torch.full((n_part + 1, nhead), float("-inf"), device=dev)
    slot = torch.where(live & (part >= 0), part.clamp(0, n_part - 1), n_part)
    logits.index_put_((slot,), out)
    attn_lse.index_put_((slot,), lse)

    kk = torch.arange(n_part, device=dev)
    tile = torch.searchsorted(reduce_indptr[: bs + 1].to(i64), kk, right=True) - 1
    tile = torch.where(kk < reduce_indptr[bs].to(i64), tile, bs)
    src = reduce_partial_map.to(i64).clamp(0, n_part - 1)
    part_lse = attn_lse[src]
    top = torch.full((bs + 1, nhead), float("-inf"), device=dev)
    top = top.scatter_reduce(0, tile[:, None].expand(-1, nhead), part_lse, "amax")
    w = torch.exp(part_lse - top[tile]).nan_to_num(0.0)
    den = torch.zeros(bs + 1, nhead, device=dev).index_add(0, tile, w)
    num = torch.zeros(bs + 1, nhead, d_v, device=dev).index_add(
        0, tile, w[..., None] * logits[src]
    )
    merged = (num / den[..., None]).nan_to_num(0.0)
    merged_lse = top + torch.log(den)
    final = torch.where(n_red > 0, reduce_final_map[:bs, 0].to(i64), total_s)
    o_acc.index_put_((final,), merged[:bs])
    lse_acc.index_put_((final,), merged_lse[:bs])

    o.copy_(o_acc[:total_s])
    final_lse = lse_acc[:total_s].clone() if return_lse else None
    return logits[:n_part, None], final_lse
