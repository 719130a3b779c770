"""Issue 38's candidate stage 1 of the grouped TurboQuant decode, beside
0009's in tq_decode_bench.py (``--cand``): 0009's kernel with its operand
work cut, each cut a constexpr so that one run measures what each costs in
time and in error.

  SHFL   MSE keys: the centroid of each code read from the lane that holds
         it (``shfl.sync`` by inline PTX; each lane holds entry lane % 16 of
         the table, its fp16 high and low parts in one register) instead of
         a gather from global memory with a 64-bit address a code.
  MAGIC  value codes to fp16 as (code | 0x6400) - 1024 (LOP3 and HADD)
         instead of I2F, a quarter-rate instruction.
  LO_QC  1: the query and the centroids as fp16 high and low parts (0009's
         numerics, three MMAs a half); 0: fp16 alone (one).
  LO_P   1: p x scale as high and low parts (0009, two MMAs a half); 0: one.

Stage 2 and the split count are 0009's (the tree's module ``gd``).
Triton's interpreter runs no inline PTX: there SHFL is taken as 0.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from vllm.v1.attention.ops import triton_turboquant_grouped_decode as gd
from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15
from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
    _code_dims,
    _codes,
    _load_fp16,
)

# Runs kept in results/cand-2026-11-29/: first (cand_exact SHFL=1 MAGIC=1
# LO_QC=1 LO_P=1, cand_p LO_QC=0, cand_fast LO_P=0 too), second (cand_g:
# cand_p with SHFL=0; probes NC_OFF=1: no norm correction, WARPS=8,
# BLOCK_KV=32).
FORM_VARIANTS = {
    "cand_g": dict(SHFL=0, MAGIC=1, LO_QC=0, LO_P=1),
}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Entry lane % 16 of sixteen operands ($1-$16), picked by predicated moves.
_LANE_TABLE_ASM = tl.constexpr(
    "{ .reg .u32 l; .reg .pred p; mov.u32 l, %laneid; and.b32 l, l, 15; "
    "mov.b32 $0, $1; "
    + " ".join(f"setp.eq.u32 p, l, {i}; @p mov.b32 $0, ${i + 1};" for i in range(1, 16))
    + " }"
)
_LANE_TABLE_REGS = tl.constexpr("=r" + ",r" * 16)
_SHFL_ASM = tl.constexpr("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;")


@triton.jit
def _packed_centroid(Centroids_ptr, i: tl.constexpr, N: tl.constexpr):
    """Centroid i % N as one int32: its fp16 high part in the low half, the
    fp16 low part (c - high) in the high half."""
    c = tl.load(Centroids_ptr + i % N)
    hi = c.to(tl.float16)
    lo = (c - hi.to(tl.float32)).to(tl.float16)
    hi_bits = hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return hi_bits | (lo.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _lane_table(Centroids_ptr, like, N: tl.constexpr):
    """A tensor shaped as ``like`` whose elements in each lane are that
    lane's table entry (lane % 16). Every operand is the same in every
    element, so the compiler keeps one a thread (and hoists it)."""
    z = tl.zeros_like(like)
    return tl.inline_asm_elementwise(
        _LANE_TABLE_ASM, _LANE_TABLE_REGS,
        [z + _packed_centroid(Centroids_ptr, 0, N), z + _packed_centroid(Centroids_ptr, 1, N),
         z + _packed_centroid(Centroids_ptr, 2, N), z + _packed_centroid(Centroids_ptr, 3, N),
         z + _packed_centroid(Centroids_ptr, 4, N), z + _packed_centroid(Centroids_ptr, 5, N),
         z + _packed_centroid(Centroids_ptr, 6, N), z + _packed_centroid(Centroids_ptr, 7, N),
         z + _packed_centroid(Centroids_ptr, 8, N), z + _packed_centroid(Centroids_ptr, 9, N),
         z + _packed_centroid(Centroids_ptr, 10, N), z + _packed_centroid(Centroids_ptr, 11, N),
         z + _packed_centroid(Centroids_ptr, 12, N), z + _packed_centroid(Centroids_ptr, 13, N),
         z + _packed_centroid(Centroids_ptr, 14, N), z + _packed_centroid(Centroids_ptr, 15, N)],
        dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _centroids(Centroids_ptr, table, codes, N: tl.constexpr, SHFL: tl.constexpr):
    """fp16 high and low parts of the centroids of ``codes``."""
    if SHFL:
        packed = tl.inline_asm_elementwise(
            _SHFL_ASM, "=r,r,r", [table, codes],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        hi = (packed & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        lo = (packed >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        return hi, lo
    c = tl.load(Centroids_ptr + codes)
    hi = c.to(tl.float16)
    return hi, (c - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _to_fp16(codes, MAGIC: tl.constexpr):
    if MAGIC:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return codes.to(tl.float16)


@triton.jit
def _split(x, LO: tl.constexpr):
    hi = x.to(tl.float16)
    if LO:
        return hi, (x - hi.to(tl.float32)).to(tl.float16)
    return hi, hi


@triton.jit
def _cand_stage1(
    Q_ptr, KV_cache_ptr, Block_table_ptr, Seq_lens_ptr, Centroids_ptr,
    Mid_o_ptr, Mid_lse_ptr,
    stride_qb, stride_qh, stride_cache_block, stride_cache_pos,
    stride_cache_head, stride_bt_b, num_splits,
    HEAD_DIM: tl.constexpr, KV_GROUP_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr, SLOT_ALIGN: tl.constexpr,
    KEY_FP8: tl.constexpr, KEY_BITS: tl.constexpr, MSE_BYTES: tl.constexpr,
    KPS: tl.constexpr, VALUE_BITS: tl.constexpr, VAL_DATA_BYTES: tl.constexpr,
    QK_SCALE: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr, SHFL: tl.constexpr, MAGIC: tl.constexpr,
    LO_QC: tl.constexpr, LO_P: tl.constexpr,
):  # fmt: skip
    """0009's stage 1 (see its docstring) with the cuts of this module."""
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
        q, q_lo = _split(q.to(tl.float32) * QK_SCALE, LO_QC)
    else:
        dim1, dim2 = _code_dims(offs_j, KEY_BITS)
        q1 = tl.load(q_rows + dim1[None, :], mask=h_mask[:, None], other=0.0)
        q1, q1_lo = _split(q1 * QK_SCALE, LO_QC)
        q2 = tl.load(q_rows + dim2[None, :], mask=h_mask[:, None], other=0.0)
        q2, q2_lo = _split(q2 * QK_SCALE, LO_QC)
        table = tl.zeros([BLOCK_KV, HALF], tl.int32)
        if SHFL:
            table = _lane_table(Centroids_ptr, table, 1 << KEY_BITS)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
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
            if LO_QC:
                qk = tl.dot(q_lo, tl.trans(k), qk)
        else:
            k1, k2 = _codes(KV_cache_ptr, slots, tok_mask, KEY_BITS, HALF, BLOCK_KV)
            c1_hi, c1_lo = _centroids(Centroids_ptr, table, k1, 1 << KEY_BITS, SHFL)
            c2_hi, c2_lo = _centroids(Centroids_ptr, table, k2, 1 << KEY_BITS, SHFL)
            k_scale = _load_fp16(KV_cache_ptr, slots + MSE_BYTES, tok_mask)
            if NORM_CORRECTION:
                c1 = c1_hi.to(tl.float32) + c1_lo.to(tl.float32)
                c2 = c2_hi.to(tl.float32) + c2_lo.to(tl.float32)
                c_norm_sq = tl.sum(c1 * c1 + c2 * c2, axis=1)
                k_scale = k_scale / tl.sqrt(c_norm_sq + 1e-16)
            qk = tl.dot(q1, tl.trans(c1_hi))
            qk = tl.dot(q2, tl.trans(c2_hi), qk)
            if LO_QC:
                qk = tl.dot(q1_lo, tl.trans(c1_hi), qk)
                qk = tl.dot(q2_lo, tl.trans(c2_hi), qk)
                qk = tl.dot(q1, tl.trans(c1_lo), qk)
                qk = tl.dot(q2, tl.trans(c2_lo), qk)
            qk = qk * k_scale[None, :]
        qk = tl.where(tok_mask[None, :], qk, -float("inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        vals = slots + KPS
        v1, v2 = _codes(KV_cache_ptr, vals, tok_mask, VALUE_BITS, HALF, BLOCK_KV)
        v_scale = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES, tok_mask)
        v_zero = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES + 2, tok_mask)
        pv_hi, pv_lo = _split(p * v_scale[None, :], LO_P)
        v1 = _to_fp16(v1, MAGIC)
        v2 = _to_fp16(v2, MAGIC)
        if LO_P:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv_lo, v1, tl.dot(pv_hi, v1))
            acc2 = acc2 * alpha[:, None] + tl.dot(pv_lo, v2, tl.dot(pv_hi, v2))
        else:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv_hi, v1)
            acc2 = acc2 * alpha[:, None] + tl.dot(pv_hi, v2)
        acc_zero = acc_zero * alpha + tl.sum(p * v_zero[None, :], axis=1)

    row = (bid * (KV_GROUP_SIZE * tl.num_programs(1)) + heads) * num_splits + sid
    o_rows = Mid_o_ptr + row.to(tl.int64)[:, None] * HEAD_DIM
    dim1, dim2 = _code_dims(offs_j, VALUE_BITS)
    zero = acc_zero[:, None]
    tl.store(o_rows + dim1[None, :], (acc1 + zero) / l_i[:, None], mask=h_mask[:, None])
    tl.store(o_rows + dim2[None, :], (acc2 + zero) / l_i[:, None], mask=h_mask[:, None])
    tl.store(Mid_lse_ptr + row, m_i + tl.log2(l_i), mask=h_mask)


def decode(variant: str, **kw) -> torch.Tensor:
    """0009's launcher (``gd.triton_turboquant_grouped_decode_attention``'s
    arguments) with stage 1 this module's, cut as ``VARIANTS[variant]``."""
    if variant in T_VARIANTS:
        return decode_t(variant, **kw)
    flags = dict(FORM_VARIANTS[variant])
    if INTERPRET:
        flags["SHFL"] = 0
    nc_off, w, kv = (flags.pop(k, None) for k in ("NC_OFF", "WARPS", "BLOCK_KV"))
    query, kv_cache = kw["query"], kw["kv_cache"]
    B, Hq, D = query.shape
    Hk = kv_cache.shape[2]
    key_fp8, mse_bits = kw.get("key_fp8", False), kw["mse_bits"]
    vbits, S = kw["value_quant_bits"], kw["num_kv_splits"]
    block_kv, warps, stages = gd._config(key_fp8, mse_bits, vbits)
    block_kv, warps = kv or block_kv, w or warps
    q = query if key_fp8 else query.float() @ kw["PiT"]
    mid_o, mid_lse = gd._split_mid_buffer(kw.get("mid_o_buf"), B, Hq, S, D, q.device)
    out = kw.get("output_buf")
    out = out[:B, :Hq, :D] if out is not None else torch.empty_like(query)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    strides = kv_cache.stride()[:3]
    slot_align = math.gcd(*strides, kv_cache.data_ptr() % 16 or 16, 16)
    _cand_stage1[(B, Hk, S)](
        q, kv_cache, kw["block_table"], kw["seq_lens"], kw["centroids"],
        mid_o, mid_lse, q.stride(0), q.stride(1), *strides,
        kw["block_table"].stride(0), S,
        HEAD_DIM=D, KV_GROUP_SIZE=Hq // Hk,
        BLOCK_H=max(16, triton.next_power_of_2(Hq // Hk)),
        BLOCK_SIZE=kv_cache.shape[1], BLOCK_KV=block_kv, SLOT_ALIGN=slot_align,
        KEY_FP8=1 if key_fp8 else 0, KEY_BITS=mse_bits,
        MSE_BYTES=math.ceil(D * mse_bits / 8), KPS=kw["key_packed_size"],
        VALUE_BITS=vbits, VAL_DATA_BYTES=math.ceil(D * vbits / 8),
        QK_SCALE=kw["scale"] * gd._LOG2E,
        NORM_CORRECTION=1 if kw.get("norm_correction") and not nc_off else 0,
        FP8_E4B15=_use_fp8_e4b15(q.device.index or 0),
        num_warps=warps, num_stages=stages, **flags,
    )  # fmt: skip
    gd._tq_grouped_decode_stage2[(B, Hq)](
        mid_o, mid_lse, kw["seq_lens"], out, lse, out.stride(0), out.stride(1),
        lse.stride(0), S, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_KV=block_kv, BLOCK_S=gd._BLOCK_SPLITS, LN2=gd._LN2, num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------
# The transposed candidate: tokens as the MMA's M rows (cand_t*)
# --------------------------------------------------------------------------

# (BLOCK_KV, warps, query-head rows BH: the MMA's N, at least the group;
# a register cap MAXR for ptxas, 0: none; splits x PPSM2 of the bench's).
# Run three (results/cand-2026-11-29/third/) had BH 16 at (16, 1), (32, 1),
# (32, 2), (64, 2), (32, 4), (64, 4); run four (fourth/) BH 8 at (16, 1),
# (16, 1) with MAXR 168 or twice the splits, (32, 1), (32, 2), (64, 4).
T_VARIANTS = {
    name: dict(BLOCK_KV=kv, WARPS=w, BH=bh, MAXR=r, PPSM2=p)
    for name, (kv, w, bh, r, p) in {
        "cand_t16w1h8": (16, 1, 8, 0, 1),
        "cand_t16w1h8r168": (16, 1, 8, 168, 1),
        "cand_t16w1h8r168s2": (16, 1, 8, 168, 2),
        "cand_t16w1h8r128": (16, 1, 8, 128, 1),
        "cand_t16w1h8r128s2": (16, 1, 8, 128, 2),
        "cand_t32w1h8": (32, 1, 8, 0, 1),
        "cand_t32w1h8r168": (32, 1, 8, 168, 1),
        "cand_t32w1h8r128": (32, 1, 8, 128, 1),
    }.items()
}
_NORM_SQ_SCALE = 256.0  # ||c||^2 terms as fp16 x 256: none subnormal


def _lut_asm(values: list[float]) -> str:
    """Inline PTX: four 4-bit codes (one a byte of $2) to four fp16 of
    ``values`` (up to 16, the rest 0) in $0 (codes 0, 1) and $1 (2, 3)."""
    half = torch.tensor(values + [0.0] * (16 - len(values)), dtype=torch.float16)
    bits = [int(b) & 0xFFFF for b in half.view(torch.int16).tolist()]

    def word(byte: int, first: int) -> str:
        v = sum(((bits[first + i] >> (8 * byte)) & 0xFF) << (8 * i) for i in range(4))
        return f"0x{v:08X}"

    table = [(word(b, 0), word(b, 4), word(b, 8), word(b, 12)) for b in (0, 1)]
    body = [
        "and.b32 s, $2, 0x07070707;", "shr.b32 t0, s, 4;", "or.b32 s, s, t0;",
        "prmt.b32 s, s, s, 0x0020;", "shl.b32 m, $2, 4;", "prmt.b32 m, m, m, 0xBA98;",
    ]  # fmt: skip
    for name, (a0, a1, b0, b1) in zip(("lo", "hi"), table):
        body += [
            f"mov.b32 t0, {a0};", f"mov.b32 t1, {a1};", "prmt.b32 a, t0, t1, s;",
            f"mov.b32 t2, {b0};", f"mov.b32 t3, {b1};", "prmt.b32 b, t2, t3, s;",
            f"lop3.b32 {name}, a, b, m, 0xD8;",
        ]  # fmt: skip
    body += ["prmt.b32 $0, lo, hi, 0x5140;", "prmt.b32 $1, lo, hi, 0x7362;"]
    return "{ .reg .b32 s, m, a, b, lo, hi, t0, t1, t2, t3; " + " ".join(body) + " }"


@triton.jit
def _lut(codes, ASM: tl.constexpr, SHFL: tl.constexpr, Table_ptr):
    """fp16 table entries of uint8 ``codes`` (0-15): inline PTX (SHFL=1), or
    a gather from Table_ptr (fp32) in Triton's interpreter."""
    if SHFL:
        return tl.inline_asm_elementwise(
            ASM, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4
        )
    return tl.load(Table_ptr + codes.to(tl.int32)).to(tl.float16)


@triton.jit
def _magic(codes):
    return (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _cand_t_stage1(
    Q_ptr, KV_cache_ptr, Block_table_ptr, Seq_lens_ptr, Centroids_ptr,
    Norm_sq_ptr, Mid_o_ptr, Mid_lse_ptr,
    stride_qb, stride_qh, stride_cache_block, stride_cache_pos,
    stride_cache_head, stride_bt_b, num_splits,
    HEAD_DIM: tl.constexpr, KV_GROUP_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr, SLOT_ALIGN: tl.constexpr,
    KEY_FP8: tl.constexpr, MSE_BYTES: tl.constexpr, KPS: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr, QK_SCALE: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, FP8_E4B15: tl.constexpr, SHFL: tl.constexpr,
    LUT_C: tl.constexpr, LUT_SQ: tl.constexpr, NORM_SQ_SCALE: tl.constexpr,
):  # fmt: skip
    """Stage 1 for 4-bit MSE or FP8 keys and 4-bit values with the tokens
    as the M rows: S^T = K Q^T, O^T += V^T (P^T x scale), the cache tiles the
    A operand. Query and centroids fp16; p x scale high and low parts."""
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
    q_cols = Q_ptr + bid * stride_qb + heads[None, :] * stride_qh
    if KEY_FP8:
        offs_d = tl.arange(0, HEAD_DIM)
        qT = tl.load(q_cols + offs_d[:, None], mask=h_mask[None, :], other=0.0)
        qT = (qT.to(tl.float32) * QK_SCALE).to(tl.float16)
    else:
        q1T = tl.load(q_cols + 2 * offs_j[:, None], mask=h_mask[None, :], other=0.0)
        q1T = (q1T * QK_SCALE).to(tl.float16)
        q2T = tl.load(q_cols + 2 * offs_j[:, None] + 1, mask=h_mask[None, :], other=0.0)
        q2T = (q2T * QK_SCALE).to(tl.float16)
        onesT = tl.full([HALF, BLOCK_H], 1.0, tl.float16)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc1 = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
    acc2 = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
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
            kb = tl.load(KV_cache_ptr + slots[:, None] + offs_d[None, :],
                         mask=tok_mask[:, None], other=0)  # fmt: skip
            if FP8_E4B15:
                k = kb.to(tl.float8e4b15, bitcast=True).to(tl.float16)
            else:
                k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            sT = tl.dot(k, qT)
        else:
            kb = tl.load(KV_cache_ptr + slots[:, None] + offs_j[None, :],
                         mask=tok_mask[:, None], other=0)  # fmt: skip
            c1 = _lut(kb & 0xF, LUT_C, SHFL, Centroids_ptr)
            c2 = _lut(kb >> 4, LUT_C, SHFL, Centroids_ptr)
            sT = tl.dot(c2, q2T, tl.dot(c1, q1T))
            k_scale = _load_fp16(KV_cache_ptr, slots + MSE_BYTES, tok_mask)
            sT = sT * k_scale[:, None]
            if NORM_CORRECTION:
                # ||c||^2 by an MMA on the operands already in registers:
                # (16 c)^2 in fp16, none subnormal; 256 = NORM_SQ_SCALE.
                n1 = c1 * 16.0
                n2 = c2 * 16.0
                nsq = tl.dot(n2 * n2, onesT, tl.dot(n1 * n1, onesT))
                sT = sT / tl.sqrt(nsq * (1.0 / NORM_SQ_SCALE) + 1e-16)
        sT = tl.where(tok_mask[:, None], sT, -float("inf"))

        m_new = tl.maximum(m_i, tl.max(sT, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sT - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

        vals = slots + KPS
        vb = tl.load(KV_cache_ptr + vals[:, None] + offs_j[None, :],
                     mask=tok_mask[:, None], other=0)  # fmt: skip
        v_scale = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES, tok_mask)
        v_zero = _load_fp16(KV_cache_ptr, vals + VAL_DATA_BYTES + 2, tok_mask)
        ps = p * v_scale[:, None]
        ps_hi = ps.to(tl.float16)
        ps_lo = (ps - ps_hi.to(tl.float32)).to(tl.float16)
        vbT = tl.trans(vb)
        v1T = _magic(vbT & 0xF)
        v2T = _magic(vbT >> 4)
        acc1 = acc1 * alpha[None, :] + tl.dot(v1T, ps_lo, tl.dot(v1T, ps_hi))
        acc2 = acc2 * alpha[None, :] + tl.dot(v2T, ps_lo, tl.dot(v2T, ps_hi))
        acc_zero = acc_zero * alpha + tl.sum(p * v_zero[:, None], axis=0)

    row = (bid * (KV_GROUP_SIZE * tl.num_programs(1)) + heads) * num_splits + sid
    o_cols = Mid_o_ptr + row.to(tl.int64)[None, :] * HEAD_DIM
    zero = acc_zero[None, :]
    inv = 1.0 / l_i[None, :]
    tl.store(o_cols + 2 * offs_j[:, None], (acc1 + zero) * inv, mask=h_mask[None, :])
    tl.store(o_cols + 2 * offs_j[:, None] + 1, (acc2 + zero) * inv,
             mask=h_mask[None, :])  # fmt: skip
    tl.store(Mid_lse_ptr + row, m_i + tl.log2(l_i), mask=h_mask)


_LUTS: dict[tuple, tuple] = {}


def _luts(centroids: torch.Tensor) -> tuple:
    """The centroid and ||c||^2 tables (PTX, and fp32 on the device for the
    interpreter), made once a centroids tensor (the first call is eager)."""
    key = (centroids.data_ptr(), centroids.numel())
    if key not in _LUTS:
        c = centroids.float().cpu()
        sq = c * c * _NORM_SQ_SCALE
        _LUTS[key] = (_lut_asm(c.tolist()), _lut_asm(sq.tolist()),
                      sq.to(centroids.device))  # fmt: skip
    return _LUTS[key]


def decode_t(variant: str, **kw) -> torch.Tensor:
    """As ``decode``, with the transposed stage 1 (4-bit MSE or FP8 keys,
    4-bit values)."""
    cfg = T_VARIANTS[variant]
    query, kv_cache = kw["query"], kw["kv_cache"]
    B, Hq, D = query.shape
    Hk = kv_cache.shape[2]
    key_fp8 = kw.get("key_fp8", False)
    assert kw["value_quant_bits"] == 4 and (key_fp8 or kw["mse_bits"] == 4)
    S, block_kv = kw["num_kv_splits"] * cfg["PPSM2"], cfg["BLOCK_KV"]
    q = query if key_fp8 else query.float() @ kw["PiT"]
    lut_c, lut_sq, norm_sq = _luts(kw["centroids"])
    mid_o, mid_lse = gd._split_mid_buffer(kw.get("mid_o_buf"), B, Hq, S, D, q.device)
    out = kw.get("output_buf")
    out = out[:B, :Hq, :D] if out is not None else torch.empty_like(query)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    strides = kv_cache.stride()[:3]
    slot_align = math.gcd(*strides, kv_cache.data_ptr() % 16 or 16, 16)
    _cand_t_stage1[(B, Hk, S)](
        q, kv_cache, kw["block_table"], kw["seq_lens"], kw["centroids"], norm_sq,
        mid_o, mid_lse, q.stride(0), q.stride(1), *strides,
        kw["block_table"].stride(0), S,
        HEAD_DIM=D, KV_GROUP_SIZE=Hq // Hk,
        BLOCK_H=max(cfg["BH"], triton.next_power_of_2(Hq // Hk)),
        BLOCK_SIZE=kv_cache.shape[1], BLOCK_KV=block_kv, SLOT_ALIGN=slot_align,
        KEY_FP8=1 if key_fp8 else 0, MSE_BYTES=D // 2, KPS=kw["key_packed_size"],
        VAL_DATA_BYTES=D // 2, QK_SCALE=kw["scale"] * gd._LOG2E,
        NORM_CORRECTION=1 if kw.get("norm_correction") else 0,
        FP8_E4B15=_use_fp8_e4b15(q.device.index or 0), SHFL=0 if INTERPRET else 1,
        LUT_C=lut_c, LUT_SQ=lut_sq, NORM_SQ_SCALE=_NORM_SQ_SCALE,
        num_warps=cfg["WARPS"], num_stages=1,
        **({"maxnreg": cfg["MAXR"]} if cfg["MAXR"] else {}),
    )  # fmt: skip
    gd._tq_grouped_decode_stage2[(B, Hq)](
        mid_o, mid_lse, kw["seq_lens"], out, lse, out.stride(0), out.stride(1),
        lse.stride(0), S, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_KV=block_kv, BLOCK_S=gd._BLOCK_SPLITS, LN2=gd._LN2, num_warps=4,
    )  # fmt: skip
    return out


VARIANTS = {**FORM_VARIANTS, **T_VARIANTS}
