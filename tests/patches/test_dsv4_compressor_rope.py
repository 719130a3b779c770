"""dsv4/0002: the ROCm compressor path rotates K at the chunk's first token.

``DeepseekCompressor._forward_old`` (vllm/model_executor/layers/
deepseek_compressor.py, the ROCm reference path of DeepSeek-V4's KV
compressor) compresses every ``compress_ratio`` tokens into one K entry:
softmax-gated sum (with overlap for ratio 4) -> RMSNorm -> GPT-J RoPE, and
writes it into the paged cache at the chunk's last token. RoPE must use the
position of the chunk's FIRST token, ``(p // ratio) * ratio``, as the fused
kernels of the CUDA path do; the unpatched code used the last one.

The cache insert is a compiled kernel (or a Triton one for head 512): it is
stubbed, and what ``_forward_old`` hands it is checked against a reference
computed here in float64 from the same inputs. So are the GEMM (a compiled
op) and the TP linear layer (only its weight is used).

Regression tests: ``test_forward_old_matches_reference``,
``test_rope_positions_are_first_token_of_chunk`` (both state the first-token
position the patch claims), and ``test_forward_old_matches_fused_kernel``,
which does not: it runs the CUDA path's fused Triton kernels on the same
inputs (on CPU in Triton's interpreter) and compares what they write,
dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import tqharness as h

HIDDEN = 32
ROPE_DIM = 64
EPS = 1e-6
MAX_POS = 1024
ROPE_BASE = 10000.0

# (compress_ratio, head_dim) of DeepSeek-V4's compressors: C4A sparse-attn K,
# C4A indexer K, C128A sparse-attn K.
CASES = [(4, 512), (4, 128), (128, 512)]


def chunk_lengths(ratio: int) -> list[int]:
    return [1, ratio - 1, ratio + 1, 2 * ratio + 3]


class _WeightOnly(torch.nn.Module):
    """Stand-in for MergedColumnParallelLinear: the compressor only reads
    ``.weight`` (its GEMM is a compiled op), and the real layer needs a
    tensor-parallel group."""

    def __init__(self, input_size: int, output_sizes: list[int], **_) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=torch.bfloat16),
            requires_grad=False,
        )


@pytest.fixture
def compressor_mod(vllm_tree: Path, cpu_platform) -> ModuleType:
    import vllm.model_executor.layers.deepseek_compressor as mod

    return mod


def cos_sin_cache(device: torch.device) -> torch.Tensor:
    """[max_pos, rope_dim]: cos of every pair, then sin (GPT-J layout)."""
    pos = torch.arange(MAX_POS, dtype=torch.float64)
    inv_freq = ROPE_BASE ** (-torch.arange(0, ROPE_DIM, 2) / ROPE_DIM)
    ang = pos[:, None] * inv_freq.double()[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float().to(device)


class Harness:
    """A DeepseekCompressor with its forward context and cache insert stubbed."""

    def __init__(
        self,
        mod: ModuleType,
        monkeypatch: pytest.MonkeyPatch,
        ratio: int,
        head_dim: int,
        device: torch.device,
        rocm: bool = True,
    ) -> None:
        from vllm.config import VllmConfig, set_current_vllm_config

        self.mod, self.ratio, self.head_dim, self.device = mod, ratio, head_dim, device
        monkeypatch.setattr(mod, "MergedColumnParallelLinear", _WeightOnly)
        monkeypatch.setattr(
            mod,
            "current_platform",
            SimpleNamespace(device_type=device.type, is_rocm=lambda: rocm),
        )
        # router_gemm_bf16_fp32 (compiled): bf16 inputs, fp32 accumulate/output.
        monkeypatch.setattr(
            mod, "cublas_gemm_bf16_bf16_fp32", lambda x, w: x.float() @ w.float().T
        )
        self.captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        monkeypatch.setattr(mod, "quantize_and_insert_k_cache", self._capture)
        monkeypatch.setattr(mod.ops, "indexer_k_quant_and_cache", self._capture)
        self._ctx = SimpleNamespace(attn_metadata=None, additional_kwargs={})
        monkeypatch.setattr(mod, "get_forward_context", lambda: self._ctx)

        self.vllm_config = VllmConfig()
        hf = SimpleNamespace(qk_rope_head_dim=ROPE_DIM, rms_norm_eps=EPS)
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf, max_model_len=MAX_POS),
            scheduler_config=SimpleNamespace(max_num_seqs=64),
            compilation_config=self.vllm_config.compilation_config,
        )
        with set_current_vllm_config(self.vllm_config):
            self.comp = mod.DeepseekCompressor(
                cfg,
                compress_ratio=ratio,
                hidden_size=HIDDEN,
                head_dim=head_dim,
                rotate=True,
                prefix="layers.0.attn.compressor",
                k_cache_prefix="layers.0.attn",
            ).to(device)
        gen = torch.Generator().manual_seed(ratio * 1000 + head_dim)
        c = self.comp
        c.fused_wkv_wgate.weight.data.copy_(
            torch.randn(c.fused_wkv_wgate.weight.shape, generator=gen) * 0.3
        )
        c.ape.data.copy_(torch.randn(c.ape.shape, generator=gen))
        c.norm.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, generator=gen))
        self.rotary_emb = SimpleNamespace(cos_sin_cache=cos_sin_cache(device))
        self.kv_cache = SimpleNamespace(kv_cache=torch.empty(0, 64, 0))
        self.vllm_config.compilation_config.static_forward_context[c.k_cache_prefix] = (
            self.kv_cache
        )

    def _capture(self, k: torch.Tensor, kv_cache, slot_mapping, *args, **kw) -> None:
        self.captured.append((k.clone(), slot_mapping.clone()))

    def forward(self, reqs: list[tuple[str, int, torch.Tensor, int]]) -> None:
        """One step: (req_id, first position, tokens, slot base) per request."""
        if not reqs:
            return
        x = torch.cat([t for _, _, t, _ in reqs]).to(self.device)
        positions = torch.cat([torch.arange(p, p + len(t)) for _, p, t, _ in reqs]).to(
            self.device
        )
        req_idx = torch.cat(
            [torch.full((len(r[2]),), i, dtype=torch.int32) for i, r in enumerate(reqs)]
        ).to(self.device)
        # Slot of (request, position): slot base + position, so that every
        # write can be traced back.
        slots = torch.cat(
            [torch.arange(p, p + len(t)) + base for _, p, t, base in reqs]
        ).to(self.device)
        c = self.comp
        self._ctx.attn_metadata = {
            c.state_cache.prefix: SimpleNamespace(token_to_req_indices=req_idx),
            c.k_cache_prefix: SimpleNamespace(slot_mapping=slots),
        }
        self._ctx.additional_kwargs = {"req_ids": [r for r, _, _, _ in reqs]}
        c.forward(x, positions, self.rotary_emb)

    def written(self, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows by slot, times each slot was written)."""
        rows = torch.zeros(n_slots, self.head_dim, dtype=torch.bfloat16)
        count = torch.zeros(n_slots, dtype=torch.int64)
        for k, slots in self.captured:
            assert k.dtype == torch.bfloat16 and k.shape == (len(slots), self.head_dim)
            rows[slots.cpu()] = k.cpu()
            count.index_add_(0, slots.cpu(), torch.ones_like(slots.cpu()))
        return rows, count


def reference(h: Harness, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Compressed K entries of one request, keyed by the position of the
    chunk's last token (where they are written), in float64:
    compress -> RMSNorm -> GPT-J RoPE at the chunk's first token."""
    c, r, d = h.comp, h.ratio, h.head_dim
    w = c.fused_wkv_wgate.weight.detach().double().cpu()
    ape = c.ape.detach().double().cpu()
    norm_w = c.norm.weight.detach().double().cpu()
    kv_score = x.double() @ w.T
    width = kv_score.shape[-1] // 2
    kv, score = kv_score[:, :width], kv_score[:, width:]
    overlap = r == 4
    pairs = torch.arange(0, ROPE_DIM, 2, dtype=torch.float64)
    inv_freq = ROPE_BASE ** (-pairs / ROPE_DIM)
    out = {}
    for i in range(x.shape[0] // r):
        cur = slice(i * r, (i + 1) * r)
        half = slice(d, 2 * d) if overlap else slice(0, d)
        vals = [kv[cur, half]]
        logits = [score[cur, half] + ape[:, half]]
        if overlap and i > 0:  # previous chunk, first half of the features
            prev = slice((i - 1) * r, i * r)
            vals.append(kv[prev, :d])
            logits.append(score[prev, :d] + ape[:, :d])
        comp = (torch.softmax(torch.cat(logits), dim=0) * torch.cat(vals)).sum(0)
        y = comp / torch.sqrt(comp.square().mean() + EPS) * norm_w
        ang = (i * r) * inv_freq
        even, odd = y[d - ROPE_DIM :: 2].clone(), y[d - ROPE_DIM + 1 :: 2].clone()
        y[d - ROPE_DIM :: 2] = even * ang.cos() - odd * ang.sin()
        y[d - ROPE_DIM + 1 :: 2] = odd * ang.cos() + even * ang.sin()
        out[(i + 1) * r - 1] = y
    return out


def scenarios(ratio: int) -> Iterator[tuple[int, int]]:
    """(prefix length, chunk length) for prefixes 0 .. 2 * ratio + 1: every
    chunk length for each prefix at ratio 4; at ratio 128 the chunk lengths
    take turns (each still meets ~65 prefixes), which keeps the CPU run short.
    """
    lengths = chunk_lengths(ratio)
    for prefix in range(2 * ratio + 2):
        if ratio <= 8:
            yield from ((prefix, chunk) for chunk in lengths)
        else:
            yield prefix, lengths[prefix % len(lengths)]


def run_scenarios(
    h: Harness, group: int = 24, only: list[tuple[int, int]] | None = None
) -> dict[str, tuple[int, int, torch.Tensor]]:
    """Each scenario is one request: its prefix in one step (if any), then
    the chunk in the next; requests are batched ``group`` at a time.
    ``only``: these (prefix, chunk) scenarios instead of ``scenarios()``.
    Returns {request id: (slot base, prefix length, tokens)}."""
    gen = torch.Generator().manual_seed(7)
    reqs = {}
    base = 0
    for prefix, chunk in only or scenarios(h.ratio):
        x = torch.randn(prefix + chunk, HIDDEN, generator=gen).bfloat16()
        reqs[f"p{prefix}-c{chunk}"] = (base, prefix, x)
        base += len(x)
    names = list(reqs)
    for lo in range(0, len(names), group):
        batch = names[lo : lo + group]
        first = [(r, 0, reqs[r][2][: reqs[r][1]], reqs[r][0]) for r in batch]
        h.forward([b for b in first if len(b[2])])
        h.forward(
            [(r, reqs[r][1], reqs[r][2][reqs[r][1] :], reqs[r][0]) for r in batch]
        )
    return reqs


@pytest.mark.bug_signature(AssertionError, r"entries at \[[\d, ]*\]: .*not close")
@pytest.mark.parametrize("ratio,head_dim", CASES)
def test_forward_old_matches_reference(
    compressor_mod: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
    ratio: int,
    head_dim: int,
) -> None:
    """Regression: every row ``_forward_old`` hands the cache insert, for
    prefix lengths 0 .. 2 * ratio + 1 and several chunk lengths, equals the
    reference (entries rotated at their chunk's first token, zeros
    elsewhere)."""
    h = Harness(compressor_mod, monkeypatch, ratio, head_dim, device)
    reqs = run_scenarios(h)
    rows, count = h.written(max(b + len(x) for b, _, x in reqs.values()))
    assert count.max() <= 1, "a slot was written twice"
    n_entries = 0
    for name, (base, _, x) in reqs.items():
        expect = reference(h, x.float())
        n_entries += len(expect)
        got, times = rows[base : base + len(x)], count[base : base + len(x)]
        emitted = torch.zeros(len(x), dtype=torch.bool)
        emitted[list(expect)] = True
        # Rows without an entry may be written (as zeros) or skipped.
        assert not got[~emitted].any(), f"{name}: non-zero row off the boundaries"
        if not expect:
            continue
        assert times[emitted].all(), f"{name}: compressed entry not written"
        at = sorted(expect)
        torch.testing.assert_close(
            got[emitted].double(),
            torch.stack([expect[p] for p in at]),
            atol=2e-2,
            rtol=2e-2,
            msg=lambda m, name=name, at=at: f"{name}, entries at {at}: {m}",
        )
    assert n_entries > 0


@pytest.mark.bug_signature(
    AssertionError, r"^RoPE positions \[.*\], want the first token of each chunk"
)
def test_rope_positions_are_first_token_of_chunk(
    compressor_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """The RoPE position each emitted entry gets: spy on apply_gptj_rope_ref
    while a ratio-4 request decodes one token at a time."""
    h = Harness(compressor_mod, monkeypatch, 4, 512, device)
    seen: list[int] = []
    real = compressor_mod.apply_gptj_rope_ref

    def spy(x, positions, cache, rope_dim):
        seen.extend(positions.tolist())
        return real(x, positions, cache, rope_dim)

    monkeypatch.setattr(compressor_mod, "apply_gptj_rope_ref", spy)
    x = torch.randn(14, HIDDEN, generator=torch.Generator().manual_seed(3))
    for p in range(14):
        h.forward([("r", p, x[p : p + 1].bfloat16(), 0)])
    assert seen == [0, 4, 8], (
        f"RoPE positions {seen}, want the first token of each chunk [0, 4, 8]"
    )


# ---------------------------------------------------------------------------
# The CUDA path's fused Triton kernels on the same inputs: an independent
# check of the RoPE position (the reference above encodes the patch's claim).
# On a GPU they run compiled; on CPU in Triton's interpreter (conftest sets
# TRITON_INTERPRET=1 there), on fewer requests.
# ---------------------------------------------------------------------------

# (prefix, chunk) requests for the interpreter: every chunk length after
# prefixes on and around the boundaries at ratio 4; at ratio 128 a two-entry
# chunk without prefix, a decode step that completes a chunk begun in the
# previous step, and a chunk whose entry spans both steps.
INTERPRETED = {
    4: [(p, c) for p in (0, 1, 3, 4, 6) for c in chunk_lengths(4)],
    128: [(0, 259), (126, 1), (200, 129)],
}


def _dequant_sparse_attn(row: torch.Tensor) -> torch.Tensor:
    """One 512-dim entry of the fp8_ds_mla K cache: 448 fp8 (UE8M0 scale per
    64) + 64 bf16 rope; ``row`` is its 576 data bytes then 8 scale bytes."""
    nope = row[:448].view(torch.float8_e4m3fn).float()
    rope = row[448:576].view(torch.bfloat16).float()
    scales = torch.exp2(row[576:583].float() - 127.0).repeat_interleave(64)
    return torch.cat([nope * scales, rope])


def _dequant_indexer(row: torch.Tensor) -> torch.Tensor:
    """One 128-dim indexer K entry: 128 fp8 then a float32 scale."""
    return row[:128].view(torch.float8_e4m3fn).float() * row[128:132].view(
        torch.float32
    )


def run_fused(
    nv: Harness, reqs: dict[str, tuple[int, int, torch.Tensor]], max_slot: int
) -> torch.Tensor:
    """The requests through the CUDA path (``forward``: the state-saving
    kernel, then the fused compress+norm+RoPE+quant+insert kernel), with a
    paged state cache (one block per ``block_size`` positions of a request)
    and K cache (slot = base + position, as in Harness.forward). Returns the
    K cache as (blocks, bytes)."""
    dev = nv.device
    blk = nv.comp.state_cache.block_size
    max_len = max(len(x) for _, _, x in reqs.values())
    blocks_per_req = math.ceil(max_len / blk)
    state_w = nv.comp.state_cache.state_dim
    nv.comp.state_cache.kv_cache = torch.zeros(
        len(reqs) * blocks_per_req, blk, state_w, dtype=torch.float32, device=dev
    )
    head_bytes = 584 if nv.head_dim == 512 else 132
    kv_cache = torch.zeros(
        math.ceil(max_slot / KV_BLK), KV_BLK, head_bytes, dtype=torch.uint8, device=dev
    )
    nv.kv_cache.kv_cache = kv_cache
    table = {r: i for i, r in enumerate(reqs)}

    def step(batch: list[tuple[str, int, torch.Tensor]]) -> None:
        if not batch:
            return
        x = torch.cat([t for _, _, t in batch]).to(dev)
        pos = torch.cat([torch.arange(p, p + len(t)) for _, p, t in batch]).to(dev)
        req_idx = torch.cat(
            [
                torch.full((len(b[2]),), i, dtype=torch.int32)
                for i, b in enumerate(batch)
            ]
        ).to(dev)
        first_block = torch.tensor([table[r] * blocks_per_req for r, _, _ in batch])
        block_table = (
            (first_block[:, None] + torch.arange(blocks_per_req)[None, :])
            .to(torch.int32)
            .to(dev)
        )
        state_slots = block_table[req_idx.long(), pos // blk].long() * blk + pos % blk
        kv_slots = torch.cat(
            [torch.arange(p, p + len(t)) + reqs[r][0] for r, p, t in batch]
        ).to(dev)
        c = nv.comp
        nv._ctx.attn_metadata = {
            c.state_cache.prefix: SimpleNamespace(
                token_to_req_indices=req_idx,
                slot_mapping=state_slots,
                block_table=block_table,
                block_size=blk,
            ),
            c.k_cache_prefix: SimpleNamespace(slot_mapping=kv_slots),
        }
        c.forward(x, pos, nv.rotary_emb)

    names = list(reqs)
    for lo in range(0, len(names), 24):
        batch = names[lo : lo + 24]
        step([(r, 0, reqs[r][2][: reqs[r][1]]) for r in batch if reqs[r][1]])
        step([(r, reqs[r][1], reqs[r][2][reqs[r][1] :]) for r in batch])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return kv_cache.view(kv_cache.shape[0], -1)


KV_BLK = 64  # tokens per K cache block


def read_entry(flat: torch.Tensor, slot: int, head_dim: int) -> torch.Tensor:
    """One dequantized K entry the fused kernel wrote."""
    blk_i, off = divmod(slot, KV_BLK)
    width, scale = (576, 8) if head_dim == 512 else (128, 4)
    data = flat[blk_i, off * width : (off + 1) * width]
    at = KV_BLK * width + off * scale
    sc = flat[blk_i, at : at + scale]
    row = torch.cat([data, sc]).cpu()
    return _dequant_sparse_attn(row) if head_dim == 512 else _dequant_indexer(row)


@pytest.mark.bug_signature(
    AssertionError, r"RoPE part of the entry at slot \d+ differs from the fused"
)
@pytest.mark.parametrize("ratio,head_dim", CASES)
def test_forward_old_matches_fused_kernel(
    compressor_mod: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
    ratio: int,
    head_dim: int,
) -> None:
    """Regression, independent of the reference's RoPE position: the same
    requests through the CUDA path (``forward`` with the fused
    compress+norm+RoPE+quant+insert kernel) write, once dequantized, what
    ``_forward_old`` hands its cache insert: the RoPE part first (bf16 for
    head 512, FP8 for the indexer's 128), then the whole entry to FP8
    accuracy."""
    interpreted = device.type == "cpu"
    casts = h.exact_fp8_casts(monkeypatch.setattr) if interpreted else None
    only = INTERPRETED[ratio] if interpreted else None
    old = Harness(compressor_mod, monkeypatch, ratio, head_dim, device, rocm=True)
    reqs = run_scenarios(old, only=only)
    max_slot = max(base + len(x) for base, _, x in reqs.values())
    expect, _ = old.written(max_slot)

    nv = Harness(compressor_mod, monkeypatch, ratio, head_dim, device, rocm=False)
    nv.comp.load_state_dict(old.comp.state_dict())
    flat = run_fused(nv, reqs, max_slot)
    assert casts is None or casts, "the interpreter's fp8 cast was not replaced"

    rope = slice(head_dim - ROPE_DIM, head_dim)
    n = 0
    for slot in expect.any(dim=-1).nonzero().flatten().tolist():
        want = expect[slot].detach().float()  # the fused kernel writes only these
        got = read_entry(flat, slot, head_dim)
        # FP8 e4m3 with a power-of-two block scale: 2^-4 relative, plus the
        # subnormal step of the block; the RoPE part of head 512 is bf16.
        step_abs = float(want.abs().max() / 448 * 2**-6 * 4) + 1e-3
        tol = (2e-2, 2e-2) if head_dim == 512 else (step_abs, 0.07)
        torch.testing.assert_close(
            got[rope],
            want[rope],
            atol=tol[0],
            rtol=tol[1],
            msg=lambda m, slot=slot: (
                f"RoPE part of the entry at slot {slot} differs from the fused "
                f"kernel's: {m}"
            ),
        )
        torch.testing.assert_close(
            got,
            want,
            atol=step_abs,
            rtol=0.07,
            msg=lambda m, slot=slot: f"entry at slot {slot} (FP8 part): {m}",
        )
        n += 1
    assert n > 0
