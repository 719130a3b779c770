"""Issue 54's first step, a prototype measured before any patch: the
grouped decode's registers stage 1 (tq-v0.33/0010) reading a page-local
plane layout, its token loop software-pipelined, so that the cost of the
layout change through every writer and reader of the cache is known to buy
the speed first.

The layout (``to_plane_layout``): the same bytes a page as v0.33.0's
(blocks, block, Hk, slot), moved to (blocks, Hk, block x slot), each
(page, KV head) record holding its tokens' planes one after another:

    [key codes block x KB][value codes block x VB]
    [norms block x 2 (MSE keys)][scales block x 2][zeros block x 2]

KB: D / 2 (4-bit MSE) or D (FP8), VB: D / 2. With a block of 16 tokens
every plane starts 16-byte aligned and a tile's key (or value) codes are
one contiguous read of 16 x KB bytes: 16-byte vector loads, where the
slot layout's 2-byte-aligned slots (262 bytes at D 256) give 2-byte loads
that are repacked with byte permutes. For turboquant_4bit_nc it is the
layout of vllm#53060 (tqpeer.to_peer_layout), no value changed.

``plane_decode_attention`` takes the arguments of the tree's
``triton_turboquant_grouped_decode_attention`` (the tree's stage 2 and
helpers, unchanged) with the cache in this layout and ``block_size``;
``config`` (tokens a step, warps, pipeline stages; 0010's by default)
is the caller's.

The second layout (``to_soa_layout``, ``layout="soa"``) is v0.33.0's own
turboquant_soa (its store, dequantization and decode exist, used on ROCm):
per page a data region [block, Hk, key codes + value codes] (a token's
code rows 16-byte aligned at every head size served but k3v4 at D 64),
then the fp16 fields as [Hk, field, block] arrays. Its store folds the
norm correction into the norm (norm / ||c||, fp32, rounded once to fp16),
so its decode drops the correction's squares, MMAs and square root
(``norm_correction=False``); ``folded_norms`` gives those norms for a
cache of the other layout, for either layout (``norms=``), and for the
float64 reference of such a cache.

``variant(NAME)`` (NAME: plane|soa + ``K w W s S`` + ``c`` for folded
norms, e.g. soa16w1s1c) is one configuration with the tree's grouped
decode's interface over a v0.33.0 cache (converted once a cache
version): the decode accuracy suite's ``--variant NAME=THIS_FILE``.
Served: 4-bit values with 4-bit MSE or FP8 keys (``PRESETS``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
from vllm.v1.attention.ops.triton_turboquant_grouped_decode import (
    _centred_nibbles_fp16,
    _centroids_fp16,
    _split_fp16,
    _squared,
    _tile_weights,
)

CONVERTS_CACHE = True  # the suite's memory: a copy of each cache
CONFIG = (16, 1, 1)  # BLOCK_KV, num_warps, num_stages: 0010's (the default)
PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4")  # 4-bit values, 4-bit or FP8 keys


def plane_bytes(cfg) -> tuple[int, int, int]:
    """Key code, value code and fp16-field bytes of a token."""
    d = cfg.head_dim
    kb = d if cfg.key_fp8 else d // 2
    return kb, d // 2, 4 if cfg.key_fp8 else 6


def _fields(slots: torch.Tensor, cfg) -> tuple[tuple[int, int], ...]:
    """The byte ranges of a v0.33.0 slot: key codes, value codes, then its
    fp16 fields (norm for MSE keys, value scale, value zero)."""
    kb, vb, fields = plane_bytes(cfg)
    kps = cfg.key_packed_size
    if kb + vb + fields != slots.shape[-1]:
        raise ValueError(f"slot of {slots.shape[-1]} bytes: {kb + vb + fields}")
    norm = () if cfg.key_fp8 else ((kb, kb + 2),)
    return ((0, kb), (kps, kps + vb), *norm, (kps + vb, kps + vb + 2),
            (kps + vb + 2, kps + vb + 4))  # fmt: skip


def folded_norms(slots: torch.Tensor, cfg, centroids: torch.Tensor) -> torch.Tensor:
    """(blocks, block, Hk) fp16 norm / ||c|| of 4-bit MSE keys: what a store
    folding the norm correction (v0.33.0's turboquant_soa store) holds, from
    the slot's fp16 norm and the codes' fp32 centroids."""
    kb = plane_bytes(cfg)[0]
    c = centroids.float()
    out = torch.empty(slots.shape[:3], dtype=torch.float16, device=slots.device)
    for a in range(0, slots.shape[0], step := 1 << 12):
        part = slots[a : a + step]
        codes = part[..., :kb]
        sq = (c[(codes & 0xF).long()] ** 2).sum(-1)
        sq += (c[(codes >> 4).long()] ** 2).sum(-1)
        norm = part[..., kb : kb + 2].contiguous()
        norm = norm.view(torch.float16).squeeze(-1).float()
        out[a : a + step] = (norm / torch.sqrt(sq + 1e-16)).half()
    return out


def _with_norms(part: torch.Tensor, cfg, norms: torch.Tensor | None) -> torch.Tensor:
    """``part`` (n, block, Hk, slot), its norm bytes replaced by ``norms``."""
    if norms is None:
        return part
    kb = plane_bytes(cfg)[0]
    part = part.clone()
    part[..., kb : kb + 2] = norms.unsqueeze(-1).view(torch.uint8)
    return part


def to_plane_layout(
    slots: torch.Tensor, cfg, norms: torch.Tensor | None = None, step: int = 1 << 15
) -> torch.Tensor:
    """The bytes of a v0.33.0 cache (blocks, block, Hk, slot) in the
    page-local plane layout (blocks, Hk, block x slot), ``step`` blocks at
    a time; with ``norms`` (``folded_norms``) in place of the slots'."""
    nb, bs, hk, slot = slots.shape
    cuts = _fields(slots, cfg)
    out = torch.empty(nb, hk, bs * slot, dtype=torch.uint8, device=slots.device)
    for a in range(0, nb, step):
        part = _with_norms(slots[a : a + step], cfg, _part(norms, a, step))
        part = part.permute(0, 2, 1, 3)  # (n, Hk, block, slot)
        n = part.shape[0]
        out[a : a + n] = torch.cat(
            [part[..., x:y].reshape(n, hk, -1) for x, y in cuts], -1
        )
    return out


def to_soa_layout(
    slots: torch.Tensor, cfg, norms: torch.Tensor | None = None, step: int = 1 << 15
) -> torch.Tensor:
    """The bytes of a v0.33.0 cache (blocks, block, Hk, slot) in v0.33.0's
    turboquant_soa layout (blocks, block x Hk x slot): a data region
    [block, Hk, key codes + value codes], then [Hk, fields, block] fp16
    (norm for MSE keys, value scale, value zero); with ``norms`` in place
    of the slots' (that store folds the norm correction)."""
    nb, bs, hk, slot = slots.shape
    cuts = _fields(slots, cfg)
    data, fields = cuts[:2], cuts[2:]
    out = torch.empty(nb, bs * hk * slot, dtype=torch.uint8, device=slots.device)
    for a in range(0, nb, step):
        part = _with_norms(slots[a : a + step], cfg, _part(norms, a, step))
        n = part.shape[0]
        rows = torch.cat([part[..., x:y] for x, y in data], -1).reshape(n, -1)
        meta = torch.stack([part[..., x:y] for x, y in fields], 1)  # n F bs Hk 2
        meta = meta.permute(0, 3, 1, 2, 4).reshape(n, -1)  # (n, Hk, F, bs, 2)
        out[a : a + n] = torch.cat([rows, meta], -1)
    return out


def _part(norms: torch.Tensor | None, a: int, step: int) -> torch.Tensor | None:
    return None if norms is None else norms[a : a + step]


@triton.jit
def _plane_stage1(
    Q_ptr,  # [B, Hq, D]: rotated fp32 query (MSE keys) or the query (FP8)
    KV_ptr,  # uint8 [num_blocks, Hk, block x slot]: the plane layout
    Half_ptr,  # the same bytes as fp16
    Block_table_ptr,  # [B, max_num_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Centroids_ptr,  # [16] float32 (where PTX is 0)
    Mid_o_ptr,  # [B, Hq, num_splits, D] float32
    Mid_lse_ptr,  # [B, Hq, num_splits] float32 (log2)
    stride_qb,
    stride_qh,
    stride_page,
    stride_head,
    stride_bt_b,
    num_splits,
    HEAD_DIM: tl.constexpr,
    KV_GROUP_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    KEY_FP8: tl.constexpr,
    KB: tl.constexpr,  # key code bytes a token
    VB: tl.constexpr,  # value code bytes a token
    QK_SCALE: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    CENTROID_LOW: tl.constexpr,
    HIGH_TABLE: tl.constexpr,
    LOW_TABLE: tl.constexpr,
    PTX: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SOA: tl.constexpr,  # 0: the plane layout, 1: turboquant_soa's
    NUM_KV_HEADS: tl.constexpr,
):
    """0010's ``_tq_grouped_decode_regs_stage1``, the same arithmetic, its
    cache reads from the plane or the SoA layout: codes as [BLOCK_KV, KB]
    tiles of 16-byte-aligned rows, fp16 fields as fp16 loads; the token
    loop pipelined over NUM_STAGES stages."""
    HALF: tl.constexpr = HEAD_DIM // 2
    ROW: tl.constexpr = KB + VB  # SoA: a token's code bytes a head
    # plane: a (page, head) record's value codes and fields after its key
    # codes; SoA: a token's value codes after its key codes, the fields
    # [Hk, field, block] after the page's data region
    V_OFF: tl.constexpr = KB if SOA else BLOCK_SIZE * KB
    K_STEP: tl.constexpr = NUM_KV_HEADS * ROW if SOA else KB
    V_STEP: tl.constexpr = NUM_KV_HEADS * ROW if SOA else VB
    FIELDS: tl.constexpr = 2 if KEY_FP8 else 3
    META: tl.constexpr = BLOCK_SIZE * NUM_KV_HEADS * ROW // 2  # SoA, fp16 units
    N_OFF: tl.constexpr = 0 if SOA else BLOCK_SIZE * ROW // 2  # fp16 units
    S_OFF: tl.constexpr = N_OFF + (0 if KEY_FP8 else BLOCK_SIZE)
    Z_OFF: tl.constexpr = S_OFF + BLOCK_SIZE
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
        q = tl.load(q_cols + offs_d[:, None], mask=h_mask[None, :], other=0.0)
        q, q_lo = _split_fp16(q.to(tl.float32) * QK_SCALE)
    else:
        q1 = tl.load(q_cols + 2 * offs_j[:, None], mask=h_mask[None, :], other=0.0)
        q1, q1_lo = _split_fp16(q1 * QK_SCALE)
        q2 = tl.load(q_cols + 2 * offs_j[:, None] + 1, mask=h_mask[None, :], other=0.0)
        q2, q2_lo = _split_fp16(q2 * QK_SCALE)
        ones = tl.full([HALF, BLOCK_H], 1.0, tl.float16)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc1 = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
    acc2 = tl.zeros([HALF, BLOCK_H], dtype=tl.float32)
    acc_zero = tl.zeros([BLOCK_H], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_KV)
    bt_row = Block_table_ptr + bid * stride_bt_b
    head_off = kv_head.to(tl.int64) * stride_head
    for start in tl.range(split_start, split_end, BLOCK_KV, num_stages=NUM_STAGES):
        tok = start + offs_n
        tok_mask = tok < split_end
        pages = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0)
        pos = tok % BLOCK_SIZE
        if SOA:
            page = pages.to(tl.int64) * stride_page
            rec = page + kv_head * ROW
            fields = page // 2 + META + kv_head * (FIELDS * BLOCK_SIZE) + pos
        else:
            rec = pages.to(tl.int64) * stride_page + head_off
            fields = rec // 2 + pos
        k_rows = tl.multiple_of(rec + pos * K_STEP, 16)
        v_rows = tl.multiple_of(rec + V_OFF + pos * V_STEP, 16)

        if KEY_FP8:
            k = tl.load(
                KV_ptr + k_rows[:, None] + offs_d[None, :],
                mask=tok_mask[:, None],
                other=0,
            )
            if FP8_E4B15:
                k = k.to(tl.float8e4b15, bitcast=True).to(tl.float16)
            else:
                k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            s = tl.dot(k, q_lo, tl.dot(k, q))
        else:
            k = tl.load(
                KV_ptr + k_rows[:, None] + offs_j[None, :],
                mask=tok_mask[:, None],
                other=0,
            )
            c1 = _centroids_fp16(k & 0xF, Centroids_ptr, HIGH_TABLE, PTX, 0)
            c2 = _centroids_fp16(k >> 4, Centroids_ptr, HIGH_TABLE, PTX, 0)
            s = tl.dot(c2, q2, tl.dot(c1, q1))
            s = tl.dot(c2, q2_lo, tl.dot(c1, q1_lo, s))
            if CENTROID_LOW:
                c1_lo = _centroids_fp16(k & 0xF, Centroids_ptr, LOW_TABLE, PTX, 1)
                c2_lo = _centroids_fp16(k >> 4, Centroids_ptr, LOW_TABLE, PTX, 1)
                s = tl.dot(c2_lo, q2, tl.dot(c1_lo, q1, s))
            norm = tl.load(Half_ptr + fields + N_OFF, mask=tok_mask, other=0.0)
            s = s * norm.to(tl.float32)[:, None]
            if NORM_CORRECTION:
                if CENTROID_LOW:
                    sq1_hi, sq1_lo = _squared(c1, c1_lo)
                    sq2_hi, sq2_lo = _squared(c2, c2_lo)
                    c_norm_sq = tl.dot(sq1_hi, ones, tl.dot(sq1_lo, ones))
                    c_norm_sq = tl.dot(sq2_lo, ones, c_norm_sq)
                    c_norm_sq = tl.dot(sq2_hi, ones, c_norm_sq)
                else:
                    c1 = c1 * 16.0
                    c2 = c2 * 16.0
                    c_norm_sq = tl.dot(c2 * c2, ones, tl.dot(c1 * c1, ones))
                s = s / tl.sqrt(c_norm_sq / 256.0 + 1e-16)
        s = tl.where(tok_mask[:, None], s, -float("inf"))

        v = tl.load(
            KV_ptr + v_rows[:, None] + offs_j[None, :],
            mask=tok_mask[:, None],
            other=0,
        )
        v_scale = tl.load(Half_ptr + fields + S_OFF, mask=tok_mask, other=0.0)
        v_scale = v_scale.to(tl.float32)
        v_zero = tl.load(Half_ptr + fields + Z_OFF, mask=tok_mask, other=0.0)
        v_zero = v_zero.to(tl.float32) + 7.5 * v_scale
        m_new, alpha, p, down = _tile_weights(s, m_i, v_scale, 0)
        l_i = l_i * alpha + tl.sum(p, axis=0) * down
        m_i = m_new
        pv_hi, pv_lo = _split_fp16(p * v_scale[:, None])
        v = tl.trans(v)
        v1 = _centred_nibbles_fp16(v & 0xF)
        v2 = _centred_nibbles_fp16(v >> 4)
        pv1 = tl.dot(v1, pv_lo, tl.dot(v1, pv_hi))
        pv2 = tl.dot(v2, pv_lo, tl.dot(v2, pv_hi))
        acc1 = acc1 * alpha[None, :] + pv1 * down[None, :]
        acc2 = acc2 * alpha[None, :] + pv2 * down[None, :]
        acc_zero = acc_zero * alpha + tl.sum(p * v_zero[:, None], axis=0) * down

    row = (bid * (KV_GROUP_SIZE * tl.num_programs(1)) + heads) * num_splits + sid
    o_cols = Mid_o_ptr + row.to(tl.int64)[None, :] * HEAD_DIM + 2 * offs_j[:, None]
    zero = acc_zero[None, :]
    tl.store(o_cols, (acc1 + zero) / l_i[None, :], mask=h_mask[None, :])
    tl.store(o_cols + 1, (acc2 + zero) / l_i[None, :], mask=h_mask[None, :])
    tl.store(Mid_lse_ptr + row, m_i + tl.log2(l_i), mask=h_mask)


def plane_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # to_plane_layout's or to_soa_layout's bytes
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    num_kv_splits: int,
    block_size: int,
    num_kv_heads: int,
    layout: str = "plane",
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    lse_buf: torch.Tensor | None = None,
    config: tuple[int, int, int] = CONFIG,
) -> torch.Tensor:
    """The grouped decode on the plane or SoA layout; [B, Hq, D] in the
    query dtype. bf16 queries (fp16 ones with 4-bit keys: the centroids'
    low parts, as 0010 takes for small batches)."""
    B, Hq, D = query.shape
    Hk, group = num_kv_heads, Hq // num_kv_heads
    device, S = query.device, num_kv_splits
    kb = D if key_fp8 else D // 2
    if value_quant_bits != 4 or not (key_fp8 or mse_bits == 4):
        raise ValueError("the plane prototype serves 4-bit values, 4-bit or FP8 keys")
    strides = kv_cache.stride()[: 1 if layout == "soa" else 2]
    if any(x % 16 for x in (*strides, kv_cache.data_ptr(), kb, D // 2)):
        raise ValueError("the plane layouts need 16-byte-aligned pages and rows")
    q = query if key_fp8 else query.float() @ PiT
    mid_o, mid_lse = gd._split_mid_buffer(mid_o_buf, B, Hq, S, D, device)
    output = (
        output_buf[:B, :Hq, :D]
        if output_buf is not None and output_buf.shape[0] >= B
        else torch.empty(B, Hq, D, dtype=query.dtype, device=device)
    )
    lse = (
        lse_buf[:B, :Hq]
        if lse_buf is not None and lse_buf.shape[0] >= B
        else torch.empty(B, Hq, dtype=torch.float32, device=device)
    )
    many = gd._many_programs(B, Hk, device)
    ptx = gd._use_ptx(device)
    # The centroids' fp16 low parts: with fp16 queries (0010's), and with
    # folded norms, which no longer divide the fp16 centroids' rounding out
    # of the score's magnitude (bf16 without them: 1.28x v0.33.0's largest
    # error at D 128, results/soa-2026-12-03/call2)
    low = not key_fp8 and (query.dtype != torch.bfloat16 or not norm_correction)
    tables = ("", "") if key_fp8 or not ptx else gd._centroid_tables_ptx(D, mse_bits)
    cap = {"maxnreg": gd._REGS_MAX_REGISTERS} if many and ptx else {}
    block_kv, warps, stages = config
    _plane_stage1[(B, Hk, S)](
        q, kv_cache, kv_cache.view(torch.float16), block_table, seq_lens,
        centroids, mid_o, mid_lse, q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(-1 if layout == "soa" else 1),
        block_table.stride(0), S,
        HEAD_DIM=D, KV_GROUP_SIZE=group, BLOCK_H=gd._regs_query_rows(group),
        BLOCK_SIZE=block_size, BLOCK_KV=block_kv, KEY_FP8=1 if key_fp8 else 0,
        KB=kb, VB=D // 2, QK_SCALE=scale * gd._LOG2E,
        NORM_CORRECTION=1 if norm_correction else 0,
        FP8_E4B15=gd._use_fp8_e4b15(device.index or 0),
        CENTROID_LOW=1 if low else 0, HIGH_TABLE=tables[0], LOW_TABLE=tables[1],
        PTX=1 if ptx else 0, NUM_STAGES=stages, SOA=1 if layout == "soa" else 0,
        NUM_KV_HEADS=Hk, num_warps=warps, num_stages=stages, **cap,
    )  # fmt: skip
    gd._tq_grouped_decode_stage2[(B, Hq)](
        mid_o, mid_lse, seq_lens, output, lse, output.stride(0),
        output.stride(1), lse.stride(0), S, HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_KV=block_kv,
        BLOCK_S=gd._BLOCK_SPLITS, LN2=gd._LN2, num_warps=4,
    )  # fmt: skip
    return output


class Variant:
    """One layout and configuration: NAME plane|soa, K w W s S, ``c`` for
    folded norms (soa16w1s1c). ``convert`` makes its cache of a v0.33.0
    cache; ``norms`` the folded norms its float64 reference takes (or
    None)."""

    def __init__(self, name: str) -> None:
        m = re.fullmatch(r"(plane|soa)(\d+)w(\d+)s(\d+)(c?)", name)
        if m is None:
            raise ValueError(f"{name!r}: plane|soa K w W s S [c], e.g. soa16w1s1c")
        self.name, self.layout = name, m[1]
        self.config = (int(m[2]), int(m[3]), int(m[4]))
        self.folded = bool(m[5])

    def convert(self, slots: torch.Tensor, cfg, centroids: torch.Tensor):
        """(cache, folded norms or None) of ``slots`` (blocks, block, Hk, slot)."""
        norms = None
        if self.folded and not cfg.key_fp8:
            norms = folded_norms(slots, cfg, centroids)
        to = to_soa_layout if self.layout == "soa" else to_plane_layout
        return to(slots, cfg, norms), norms

    def decode(self, cache: torch.Tensor, num_kv_heads: int, **args) -> torch.Tensor:
        if self.folded:
            args["norm_correction"] = False
        return plane_decode_attention(
            kv_cache=cache, num_kv_heads=num_kv_heads, layout=self.layout,
            config=self.config, **args,
        )  # fmt: skip


# The decode accuracy suite's --variant NAME=THIS_FILE: the tree's grouped
# decode's interface over a v0.33.0 cache, converted once a cache version.
_VARIANT: Variant | None = None
_CONVERTED: dict = {}


def configure(name: str) -> None:
    """The suite names the variant: ``Variant(name)``."""
    global _VARIANT
    _VARIANT = Variant(name)


def _converted(kv_cache: torch.Tensor, key_fp8: bool, kps: int, centroids):
    key = (kv_cache.data_ptr(), kv_cache._version, kv_cache.shape)
    if key not in _CONVERTED:
        _CONVERTED.clear()  # one cache at a time: the suite's memory
        cfg = SimpleNamespace(
            head_dim=plane_bytes_dim(kv_cache, key_fp8, kps),
            key_fp8=key_fp8, key_packed_size=kps,
        )  # fmt: skip
        _CONVERTED[key] = _VARIANT.convert(kv_cache, cfg, centroids)
    return _CONVERTED[key]


def plane_bytes_dim(kv_cache: torch.Tensor, key_fp8: bool, kps: int) -> int:
    """The head size of a 4-bit-value slot: kps + D / 2 + 4 bytes."""
    return (kv_cache.shape[-1] - kps - 4) * 2


def triton_turboquant_grouped_decode_attention(
    kv_cache: torch.Tensor, key_fp8: bool = False, **args
) -> torch.Tensor:
    kps, cen = args["key_packed_size"], args["centroids"]
    cache, _ = _converted(kv_cache, key_fp8, kps, cen)
    return _VARIANT.decode(
        cache, kv_cache.shape[2], block_size=kv_cache.shape[1], key_fp8=key_fp8,
        **args,
    )  # fmt: skip


def reference_norms(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The folded norms (blocks, block, Hk) the variant's cache holds for
    ``kv_cache`` in place of its norms (None: its own)."""
    for (ptr, version, _), (_, norms) in _CONVERTED.items():
        if (ptr, version) == (kv_cache.data_ptr(), kv_cache._version):
            return norms
    return None


def _config(key_fp8: bool, mse_bits: int, value_bits: int) -> tuple[int, int, int]:
    return _VARIANT.config


def grouped_decode_num_splits(batch, hk, budget, device, *_) -> int:
    return gd.grouped_decode_num_splits(batch, hk, budget, device, True)


def splits(batch: int, hk: int, budget: int, device) -> int:
    """The registers stage 1's split count (0010's)."""
    return gd.grouped_decode_num_splits(batch, hk, budget, device, True)


def compiled_info() -> list[dict]:
    """Each compiled ``_plane_stage1``: warps, stages, the asynchronous copies
    in its TTGIR (0: Triton did not pipeline the loads), registers, spills."""
    out = []
    for caches in _plane_stage1.device_caches.values():
        for kernel in caches[0].values():
            ttgir = kernel.asm.get("ttgir", "")
            out.append({
                "num_warps": kernel.metadata.num_warps,
                "num_stages": kernel.metadata.num_stages,
                "async_copies": ttgir.count("async_copy_global_to_local"),
                "local_allocs": ttgir.count("local_alloc"),
                "regs": getattr(kernel, "n_regs", None),
                "spills": getattr(kernel, "n_spills", None),
            })  # fmt: skip
    return out
