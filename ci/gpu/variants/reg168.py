# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode attention with the GQA group as a tile dimension.

Stage 1: one program per (request, KV head, KV split) reads each token's
compressed K/V bytes of that KV head once and scores them against all
``Hq // Hk`` query heads of the group on the tensor cores. Stage 2: the splits
of each query head merged by their log-sum-exp.

The split count is chosen on the host from the batch size, the KV head count
and the SM count (``grouped_decode_num_splits``): constant for a given batch
size, so a CUDA graph replays the launch it captured; each request's split
length is computed on the device from its own seq_len.

Cache layout as in ``triton_turboquant_decode``; served here: 4-bit values
with FP8 keys or 4-bit Lloyd-Max indices of the Hadamard-rotated key (the
query is rotated once, before the kernel), a power-of-two head size
(``grouped_decode_supported``). Numerics: fp16 MMA operands split into high
and low parts where they are not exact, fp32 accumulation.
"""

import math

import torch

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

# Tokens per inner step, warps and pipeline stages per program for MSE and
# for FP8 keys (the best of ci/gpu/tq_decode_bench.py's sweep on an H100), and
# the programs per SM that the split count aims for. Module constants, read at
# each launch; a benchmark may set the first three to override both presets.
_MSE_CONFIG = (64, 4, 1)
_FP8_CONFIG = (32, 4, 2)
_BLOCK_KV: int | None = None
_NUM_WARPS: int | None = None
_NUM_STAGES: int | None = None
_PROGRAMS_PER_SM = 8
# Registers per thread of stage 1 (ptxas's cap), None: ptxas's choice.
_MAXNREG: int | None = 168
# Splits merged per step of stage 2.
_BLOCK_SPLITS = 16

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """SMs (CUs on ROCm) of a CUDA device; elsewhere (XPU, Triton's
    interpreter on CPU) unknown here: 32."""
    if device.type != "cuda":
        return 32
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms_cache:
        props = torch.cuda.get_device_properties(index)
        _num_sms_cache[index] = props.multi_processor_count
    return _num_sms_cache[index]


def grouped_decode_num_splits(
    batch_size: int, num_kv_heads: int, max_splits: int, device: torch.device
) -> int:
    """KV splits per (request, KV head): enough programs to fill the GPU
    (``_PROGRAMS_PER_SM`` per SM), at most ``max_splits``. Host sizes only,
    so the launch is the same in eager mode and in a captured graph."""
    programs = max(1, batch_size * num_kv_heads)
    target = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), programs)
    return max(1, min(max_splits, target))


def grouped_decode_supported(
    head_dim: int, value_bits: int, key_fp8: bool, mse_bits: int
) -> bool:
    """4-bit values with FP8 or 4-bit MSE keys and a power-of-two head size
    of at least 32 (MMA tiles of 16 along D / 2); the other presets keep
    ``triton_turboquant_decode_attention``."""
    pow2 = head_dim >= 32 and head_dim & (head_dim - 1) == 0
    return pow2 and value_bits == 4 and (key_fp8 or mse_bits == 4)


def _config(key_fp8: bool) -> tuple[int, int, int]:
    """(BLOCK_KV, num_warps, num_stages) of stage 1 for the preset."""
    block_kv, warps, stages = _FP8_CONFIG if key_fp8 else _MSE_CONFIG
    return (_BLOCK_KV or block_kv, _NUM_WARPS or warps, _NUM_STAGES or stages)


@triton.jit
def _load_fp16(Cache_ptr, addrs, mask):
    lo = tl.load(Cache_ptr + addrs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(Cache_ptr + addrs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _split_fp16(x):
    """fp32 ``x`` as fp16 high and low parts (x = hi + lo to about 2**-22)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _tq_grouped_decode_stage1(
    Q_ptr,  # [B, Hq, D]: rotated fp32 query (MSE keys) or the query (FP8)
    KV_cache_ptr,  # uint8 [num_blocks, block_size, Hk, slot] (any strides)
    Block_table_ptr,  # [B, max_num_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Centroids_ptr,  # [16] float32
    Mid_o_ptr,  # [B, Hq, num_splits, D] float32: normalized partial outputs
    Mid_lse_ptr,  # [B, Hq, num_splits] float32: log2-sum-exp2 of the scores
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    stride_bt_b,
    num_splits,  # not constexpr: one compile for every batch size
    HEAD_DIM: tl.constexpr,  # a power of two
    KV_GROUP_SIZE: tl.constexpr,  # Hq // Hk
    BLOCK_H: tl.constexpr,  # KV_GROUP_SIZE padded to the MMA's 16 rows
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_KV: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,  # bytes every slot start is a multiple of
    KEY_FP8: tl.constexpr,
    MSE_BYTES: tl.constexpr,
    KPS: tl.constexpr,  # key packed size (value field offset)
    VAL_DATA_BYTES: tl.constexpr,
    QK_SCALE: tl.constexpr,  # softmax scale * log2(e)
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
):
    """Stage 1 for 4-bit values with FP8 or 4-bit MSE keys, on the tensor
    cores. A byte of 4-bit indices holds dims 2j (low nibble) and 2j + 1
    (high): each byte is loaded once into a [BLOCK_KV, D / 2] tile and its
    nibbles are the two halves of the product, against the query's even and
    odd dims (QK) and into the output's even and odd dims (PV). MMA operands
    are fp16 with fp32 accumulation: FP8 keys and 4-bit value codes are exact
    in fp16; the query, the centroids and p x scale are split into high and
    low parts (fp16 alone is up to twice v0.33.0's fp32 error)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    bid = tl.program_id(0)
    kv_head = tl.program_id(1)
    sid = tl.program_id(2)

    seq_len = tl.load(Seq_lens_ptr + bid)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_KV) * BLOCK_KV
    split_start = sid * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_start >= split_end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < KV_GROUP_SIZE
    heads = kv_head * KV_GROUP_SIZE + offs_h
    offs_j = tl.arange(0, HALF)
    q_rows = Q_ptr + bid * stride_qb + heads[:, None] * stride_qh
    if KEY_FP8:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_rows + offs_d[None, :], mask=h_mask[:, None], other=0.0)
        q, q_lo = _split_fp16(q.to(tl.float32) * QK_SCALE)
    else:
        q_even = tl.load(q_rows + 2 * offs_j[None, :], mask=h_mask[:, None], other=0.0)
        q_even, q_even_lo = _split_fp16(q_even * QK_SCALE)
        q_odd = tl.load(
            q_rows + 2 * offs_j[None, :] + 1, mask=h_mask[:, None], other=0.0
        )
        q_odd, q_odd_lo = _split_fp16(q_odd * QK_SCALE)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_even = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_zero = tl.zeros([BLOCK_H], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_KV)
    bt_row = Block_table_ptr + bid * stride_bt_b
    head_off = kv_head.to(tl.int64) * stride_cache_head
    for start in range(split_start, split_end, BLOCK_KV):
        tok = start + offs_n
        tok_mask = tok < split_end
        blocks = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0)
        slots = (
            blocks.to(tl.int64) * stride_cache_block
            + (tok % BLOCK_SIZE).to(tl.int64) * stride_cache_pos
            + head_off
        )
        slots = tl.multiple_of(slots, SLOT_ALIGN)

        if KEY_FP8:
            k = tl.load(
                KV_cache_ptr + slots[:, None] + offs_d[None, :],
                mask=tok_mask[:, None],
                other=0,
            )
            if FP8_E4B15:
                k = k.to(tl.float8e4b15, bitcast=True).to(tl.float16)
            else:
                k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            qk = tl.dot(q, tl.trans(k))
            qk = tl.dot(q_lo, tl.trans(k), qk)
        else:
            kb = tl.load(
                KV_cache_ptr + slots[:, None] + offs_j[None, :],
                mask=tok_mask[:, None],
                other=0,
            ).to(tl.int32)
            c_even = tl.load(Centroids_ptr + (kb & 0xF))
            c_odd = tl.load(Centroids_ptr + (kb >> 4))
            k_scale = _load_fp16(KV_cache_ptr, slots + MSE_BYTES, tok_mask)
            if NORM_CORRECTION:
                c_norm_sq = tl.sum(c_even * c_even + c_odd * c_odd, axis=1)
                k_scale = k_scale / tl.sqrt(c_norm_sq + 1e-16)
            ce_hi, ce_lo = _split_fp16(c_even)
            co_hi, co_lo = _split_fp16(c_odd)
            qk = tl.dot(q_even, tl.trans(ce_hi))
            qk = tl.dot(q_odd, tl.trans(co_hi), qk)
            qk = tl.dot(q_even_lo, tl.trans(ce_hi), qk)
            qk = tl.dot(q_odd_lo, tl.trans(co_hi), qk)
            qk = tl.dot(q_even, tl.trans(ce_lo), qk)
            qk = tl.dot(q_odd, tl.trans(co_lo), qk)
            qk = qk * k_scale[None, :]
        qk = tl.where(tok_mask[None, :], qk, -float("inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # Values: sum_t p * (code * scale + zero), the zero term apart.
        vals = slots + KPS
        vb = tl.load(
            KV_cache_ptr + vals[:, None] + offs_j[None, :],
            mask=tok_mask[:, None],
            other=0,
        ).to(tl.int32)
        v_scale = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES, tok_mask)
        v_zero = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES + 2, tok_mask)
        pv_hi, pv_lo = _split_fp16(p * v_scale[None, :])
        v_even = (vb & 0xF).to(tl.float16)
        v_odd = (vb >> 4).to(tl.float16)
        acc_even = tl.dot(pv_hi, v_even, acc_even * alpha[:, None])
        acc_even = tl.dot(pv_lo, v_even, acc_even)
        acc_odd = tl.dot(pv_hi, v_odd, acc_odd * alpha[:, None])
        acc_odd = tl.dot(pv_lo, v_odd, acc_odd)
        acc_zero = acc_zero * alpha + tl.sum(p * v_zero[None, :], axis=1)

    row = (bid * (KV_GROUP_SIZE * tl.num_programs(1)) + heads) * num_splits + sid
    o_rows = Mid_o_ptr + row.to(tl.int64)[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    zero = acc_zero[:, None]
    tl.store(o_rows, (acc_even + zero) / l_i[:, None], mask=h_mask[:, None])
    tl.store(o_rows + 1, (acc_odd + zero) / l_i[:, None], mask=h_mask[:, None])
    tl.store(Mid_lse_ptr + row, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _tq_grouped_decode_stage2(
    Mid_o_ptr,  # [B, Hq, num_splits, D] float32
    Mid_lse_ptr,  # [B, Hq, num_splits] float32 (log2)
    Seq_lens_ptr,
    Out_ptr,  # [B, Hq, D] in the query dtype
    Lse_ptr,  # [B, Hq] float32 (natural log)
    stride_ob,
    stride_oh,
    stride_lse_b,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LN2: tl.constexpr,
):
    bid = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)

    seq_len = tl.load(Seq_lens_ptr + bid)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_KV) * BLOCK_KV
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_S)
    row0 = (bid * num_heads + head).to(tl.int64) * num_splits

    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        s_mask = s0 + offs_s < num_active
        lse = tl.load(
            Mid_lse_ptr + row0 + s0 + offs_s, mask=s_mask, other=-float("inf")
        )
        o = tl.load(
            Mid_o_ptr + (row0 + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_i, tl.max(lse, axis=0))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        m_i = m_new

    # A request with no tokens (a CUDA-graph padding row) gets zeros.
    has_tokens = num_active > 0
    l_i = tl.where(has_tokens, l_i, 1.0)
    out = tl.where(has_tokens, acc / l_i, 0.0)
    tl.store(
        Out_ptr + bid * stride_ob + head * stride_oh + offs_d,
        out.to(Out_ptr.dtype.element_ty),
        mask=d_mask,
    )
    lse_out = tl.where(has_tokens, (m_i + tl.log2(l_i)) * LN2, 0.0)
    tl.store(Lse_ptr + bid * stride_lse_b + head, lse_out)


def _split_mid_buffer(
    mid_o_buf: torch.Tensor | None, B: int, Hq: int, S: int, D: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's partial outputs [B, Hq, S, D] and log-sum-exps [B, Hq, S]
    in the floats of a [B, Hq, S, D + 1] buffer (or a new one)."""
    n = B * Hq * S
    if (
        mid_o_buf is None
        or not mid_o_buf.is_contiguous()
        or mid_o_buf.numel() < n * (D + 1)
    ):
        mid_o_buf = torch.empty(n * (D + 1), dtype=torch.float32, device=device)
    flat = mid_o_buf.view(-1)
    return flat[: n * D].view(B, Hq, S, D), flat[n * D : n * (D + 1)].view(B, Hq, S)


def triton_turboquant_grouped_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [B, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    centroids: torch.Tensor,  # [2**mse_bits] float32
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    num_kv_splits: int,
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,  # [D, D] rotation (MSE keys)
    mid_o_buf: torch.Tensor | None = None,  # >= B * Hq * splits * (D + 1) fp32
    output_buf: torch.Tensor | None = None,  # [>= B, Hq, D] query dtype
    lse_buf: torch.Tensor | None = None,  # [>= B, Hq] fp32
) -> torch.Tensor:
    """Grouped TurboQuant decode attention; returns [B, Hq, D] in the query
    dtype. ``num_kv_splits`` must depend on host sizes only (see
    ``grouped_decode_num_splits``) for a CUDA graph to replay it."""
    B, Hq, D = query.shape
    if not grouped_decode_supported(D, value_quant_bits, key_fp8, mse_bits):
        raise ValueError(
            f"grouped decode: no kernel for head size {D}, {value_quant_bits}-bit "
            f"values and {'FP8' if key_fp8 else f'{mse_bits}-bit'} keys"
        )
    Hk = kv_cache.shape[2]
    group = Hq // Hk
    device = query.device
    S = num_kv_splits
    block_kv, warps, stages = _config(key_fp8)

    if key_fp8:
        q = query
    else:
        if PiT is None:
            raise ValueError("MSE keys need the rotation PiT")
        q = query.float() @ PiT  # rotated once, outside the kernel
    mid_o, mid_lse = _split_mid_buffer(mid_o_buf, B, Hq, S, D, device)

    if output_buf is not None and output_buf.shape[0] >= B:
        output = output_buf[:B, :Hq, :D]
    else:
        output = torch.empty(B, Hq, D, dtype=query.dtype, device=device)
    if lse_buf is not None and lse_buf.shape[0] >= B:
        lse = lse_buf[:B, :Hq]
    else:
        lse = torch.empty(B, Hq, dtype=torch.float32, device=device)

    strides = kv_cache.stride()[:3]
    slot_align = math.gcd(*strides, kv_cache.data_ptr() % 16 or 16, 16)
    _tq_grouped_decode_stage1[(B, Hk, S)](
        q,
        kv_cache,
        block_table,
        seq_lens,
        centroids,
        mid_o,
        mid_lse,
        q.stride(0),
        q.stride(1),
        *strides,
        block_table.stride(0),
        S,
        HEAD_DIM=D,
        KV_GROUP_SIZE=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_KV=block_kv,
        SLOT_ALIGN=slot_align,
        KEY_FP8=1 if key_fp8 else 0,
        MSE_BYTES=math.ceil(D * mse_bits / 8),
        KPS=key_packed_size,
        VAL_DATA_BYTES=D // 2,
        QK_SCALE=scale * _LOG2E,
        NORM_CORRECTION=1 if norm_correction else 0,
        FP8_E4B15=_use_fp8_e4b15(device.index or 0),
        num_warps=warps,
        num_stages=stages,
        **({'maxnreg': _MAXNREG} if _MAXNREG and query.is_cuda else {}),
    )
    _tq_grouped_decode_stage2[(B, Hq)](
        mid_o,
        mid_lse,
        seq_lens,
        output,
        lse,
        output.stride(0),
        output.stride(1),
        lse.stride(0),
        S,
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_KV=block_kv,
        BLOCK_S=_BLOCK_SPLITS,
        LN2=_LN2,
        num_warps=4,
    )
    return output