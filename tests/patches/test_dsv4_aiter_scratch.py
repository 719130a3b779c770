"""dsv4/0001: the AITER sparse-MLA scratch refreshes its work plan every step.

``aiter_sparse_attn_decode`` (vllm/v1/attention/ops/rocm_aiter_dsv4_decode.py)
runs AITER's persistent-mode kernel, whose work plan from
``aiter.get_mla_metadata_v1`` encodes the per-row kv lengths. The unpatched
``AiterSparseScratch`` builds that plan once per shape key, so the second
decode step with other lengths hands the kernel a stale plan (a GPU
memory-access fault on MI355X). AITER is not available here: ``fake_aiter``
(test code) stands in for it with AITER's signatures and contract, and
faults on a stale plan the way the real kernel does.

Regression tests: ``test_decode_steps_with_varying_lengths`` and
``test_scratch_pointers_stable_across_steps`` (they fault on the unpatched
tree). The GPU test captures the decode in a CUDA graph and replays it with
new lengths.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

FP8 = torch.float8_e4m3fn
H = 16  # heads per rank on MI355X (qh16 kernel)
TOPK_SWA, TOPK_EXTRA = 32, 64


@pytest.fixture
def fake_aiter(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Install ``fake_aiter`` as ``aiter`` for the duration of one test."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    mod = importlib.import_module("fake_aiter")
    mod.calls.clear()
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setitem(sys.modules, "aiter.mla", mod.mla)
    return mod


@pytest.fixture
def dsv4_decode(vllm_tree: Path, fake_aiter: ModuleType) -> ModuleType:
    import vllm.v1.attention.ops.rocm_aiter_dsv4_decode as mod

    return mod


@dataclass
class Step:
    """Inputs of one decode step (two scopes, as a C4A/C128A layer has)."""

    q: torch.Tensor  # (b, 1, H, d_qk) bf16
    swa_k: torch.Tensor  # (n_blk, blk, 1, d_qk) bf16
    swa_idx: torch.Tensor  # (b, 1, TOPK_SWA) int32
    swa_lens: torch.Tensor  # (b,) int32
    ext_k: torch.Tensor
    ext_idx: torch.Tensor  # (b, 1, TOPK_EXTRA) int32
    ext_lens: torch.Tensor
    sink: torch.Tensor  # (H,) fp32


def _indices(
    gen: torch.Generator, lens: list[int], topk: int, n_tok: int
) -> torch.Tensor:
    """Valid token ids before each row's length; past it a mix of -1 and
    real ids, which the length must mask out."""
    rows = []
    for n in lens:
        row = torch.randperm(n_tok, generator=gen)[:topk].to(torch.int32)
        tail = torch.rand(topk, generator=gen) < 0.5
        tail[:n] = False
        rows.append(row.masked_fill(tail, -1))
    return torch.stack(rows).unsqueeze(1)


def make_step(
    seed: int,
    swa_lens: list[int],
    ext_lens: list[int],
    d_qk: int = 64,
    device: torch.device | str = "cpu",
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    b = len(swa_lens)
    n_swa, n_ext = 3 * 16, 5 * 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    sink = randn(H)
    sink[-2:] = float("-inf")  # padded heads carry a -inf sink
    step = Step(
        q=randn(b, 1, H, d_qk).bfloat16(),
        swa_k=randn(n_swa // 16, 16, 1, d_qk).bfloat16(),
        swa_idx=_indices(gen, swa_lens, TOPK_SWA, n_swa),
        swa_lens=torch.tensor(swa_lens, dtype=torch.int32),
        ext_k=randn(n_ext // 16, 16, 1, d_qk).bfloat16(),
        ext_idx=_indices(gen, ext_lens, TOPK_EXTRA, n_ext),
        ext_lens=torch.tensor(ext_lens, dtype=torch.int32),
        sink=sink,
    )
    for name, t in vars(step).items():
        setattr(step, name, t.to(device))
    return step


def reference(step: Step, d_v: int) -> torch.Tensor:
    """Sparse attention with a sink over the union of both scopes' valid
    tokens, in float64 from the FP8-rounded q and K (the kernel's inputs)."""
    d_qk = step.q.shape[-1]
    q = step.q.to(FP8).double().cpu()[:, 0]
    sink = step.sink.double().cpu()
    out = torch.zeros(q.shape[0], H, d_v, dtype=torch.float64)
    scopes = [
        (step.swa_k, step.swa_idx, step.swa_lens),
        (step.ext_k, step.ext_idx, step.ext_lens),
    ]
    for i in range(q.shape[0]):
        keys = []
        for k_cache, idx, lens in scopes:
            k = k_cache.to(FP8).double().cpu().reshape(-1, d_qk)
            row = idx[i, 0, : int(lens[i])].cpu().long()
            keys.append(k[row[row >= 0]])
        k = torch.cat(keys)
        if k.shape[0] == 0:
            continue
        logits = q[i] @ k.T * d_qk**-0.5  # (H, n)
        top = torch.maximum(logits.max(dim=-1).values, sink)
        e = torch.exp(logits - top[:, None])
        den = e.sum(-1) + torch.exp(sink - top)
        out[i] = (e @ k[:, :d_v]) / den[:, None]
    return out


def run_decode(mod: ModuleType, step: Step, d_v: int, scratches) -> torch.Tensor:
    swa, ext = scratches
    return mod.aiter_sparse_attn_decode(
        q=step.q,
        blocked_k=step.swa_k,
        indices_in_kvcache=step.swa_idx,
        topk_length=step.swa_lens,
        attn_sink=step.sink,
        scale=step.q.shape[-1] ** -0.5,
        head_dim=d_v,
        extra_blocked_k=step.ext_k,
        extra_indices_in_kvcache=step.ext_idx,
        extra_topk_length=step.ext_lens,
        scratch=swa,
        extra_scratch=ext,
    )


def check(out: torch.Tensor, step: Step, d_v: int) -> None:
    assert out.dtype == torch.bfloat16
    assert out.shape == (step.q.shape[0], H, d_v)
    torch.testing.assert_close(
        out.double().cpu(), reference(step, d_v), atol=1e-2, rtol=1e-2
    )


# Per step: (swa lens, extra lens). Lengths cross the 16-token split
# granularity of the plan, include empty rows, and the batch shrinks once
# (a new shape key) and comes back.
STEPS = [
    ([5, 32, 0, 17], [64, 3, 40, 1]),
    ([6, 31, 1, 16], [63, 9, 41, 0]),
    ([20, 2], [33, 60]),
    ([32, 32, 32, 32], [64, 64, 64, 64]),
    ([1, 12, 30, 7], [5, 50, 17, 64]),
]


@pytest.mark.parametrize("d_qk,d_v", [(64, 64), (96, 64)])
def test_single_step_matches_reference(
    dsv4_decode: ModuleType, d_qk: int, d_v: int
) -> None:
    step = make_step(0, *STEPS[0], d_qk=d_qk)
    scratches = (dsv4_decode.AiterSparseScratch(), dsv4_decode.AiterSparseScratch())
    check(run_decode(dsv4_decode, step, d_v, scratches), step, d_v)


def _pad(idx: torch.Tensor, row: int, real: int) -> None:
    """Row ``row`` keeps its first ``real`` ids; -1 after them, also inside
    its declared length (the padding a top-k selection with fewer
    candidates than k leaves)."""
    idx[row, 0, real:] = -1


# The fake AITER faults, as the real kernel would, on a -1 it is told is a
# valid entry: that fault is how this class of bug shows (and kills mutants).
@pytest.mark.bug_signature(RuntimeError, r"Memory access fault by GPU \(fake AITER\)")
@pytest.mark.bug_signature(AssertionError, r".")
@pytest.mark.parametrize("with_lengths", [True, False], ids=["lengths", "no_lengths"])
def test_rows_without_entries_and_padded_rows(
    dsv4_decode: ModuleType, with_lengths: bool
) -> None:
    """Rows that the valid lengths alone do not describe.

    Row 1 has no valid entry in either scope: attention over the sink alone,
    output 0. Each scope's LSE is -inf there, and merging two -inf LSEs gives
    NaN weights, so the row must be masked after the merge. Rows 0 and 3
    hold -1 inside their declared length: the valid mask must drop them
    (``indices >= 0``), else ``kv_indptr`` counts them and the kernel reads
    kv index -1. Without lengths (``topk_length=None``) the -1 entries alone
    mark what is valid."""
    step = make_step(50, [5, 0, 20, 32], [64, 0, 7, 40])
    _pad(step.swa_idx, 0, 3)
    _pad(step.ext_idx, 3, 25)
    for idx in (step.swa_idx, step.ext_idx):
        _pad(idx, 1, 0)
    if not with_lengths:
        for idx, lens in ((step.swa_idx, step.swa_lens), (step.ext_idx, step.ext_lens)):
            for row, n in enumerate(lens.tolist()):
                _pad(idx, row, n)
            lens.fill_(idx.shape[-1])  # the reference: every non-negative id
    out = dsv4_decode.aiter_sparse_attn_decode(
        q=step.q,
        blocked_k=step.swa_k,
        indices_in_kvcache=step.swa_idx,
        topk_length=step.swa_lens if with_lengths else None,
        attn_sink=step.sink,
        scale=step.q.shape[-1] ** -0.5,
        head_dim=64,
        extra_blocked_k=step.ext_k,
        extra_indices_in_kvcache=step.ext_idx,
        extra_topk_length=step.ext_lens if with_lengths else None,
        scratch=dsv4_decode.AiterSparseScratch(),
        extra_scratch=dsv4_decode.AiterSparseScratch(),
    )
    assert not out[1].any(), "a row without entries must be 0 (sink only)"
    check(out, step, 64)


# The fake AITER faults like the real kernel when the plan is stale.
STALE_PLAN = r"Memory access fault by GPU \(fake AITER\)"


@pytest.mark.bug_signature(RuntimeError, STALE_PLAN)
def test_decode_steps_with_varying_lengths(dsv4_decode: ModuleType) -> None:
    """Regression: one pair of scratches (as each DSv4 layer keeps) over
    decode steps whose valid lengths change; the plan must follow."""
    scratches = (dsv4_decode.AiterSparseScratch(), dsv4_decode.AiterSparseScratch())
    for n, lens in enumerate(STEPS):
        step = make_step(10 + n, *lens)
        check(run_decode(dsv4_decode, step, 64, scratches), step, 64)


def _tensor_ptrs(obj: object) -> dict[str, int]:
    ptrs = {}
    for name in type(obj).__slots__:
        t = getattr(obj, name, None)
        if isinstance(t, torch.Tensor):
            ptrs[name] = t.data_ptr()
    return ptrs


@pytest.mark.bug_signature(RuntimeError, STALE_PLAN)
@pytest.mark.bug_signature(AssertionError, r"^plan not rewritten on every step")
def test_scratch_pointers_stable_across_steps(
    dsv4_decode: ModuleType, fake_aiter: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: across steps with one shape key, every scratch buffer and
    every tensor the kernel reads or writes (but the FP8 copy of the K cache)
    keeps its address, which is what HIP graph replay needs; and the plan is
    rewritten on every step."""
    seen: list[dict[str, int]] = []
    real = fake_aiter.mla.mla_decode_fwd

    def spy(*args, **kwargs):
        names = ["q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices"]
        names.append("kv_last_page_lens")
        got = {n: a.data_ptr() for n, a in zip(names, args, strict=False)}
        got.update(
            (n, a.data_ptr()) for n, a in kwargs.items() if isinstance(a, torch.Tensor)
        )
        del got["kv_buffer"]
        seen.append(got)
        return real(*args, **kwargs)

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", spy)
    scratches = (dsv4_decode.AiterSparseScratch(), dsv4_decode.AiterSparseScratch())
    owned = []
    for n, lens in enumerate([STEPS[0], STEPS[1], STEPS[4], STEPS[0]]):
        step = make_step(20 + n, *lens)
        check(run_decode(dsv4_decode, step, 64, scratches), step, 64)
        owned.append([_tensor_ptrs(s) for s in scratches])

    # Kernel inputs: scope by scope, the same addresses at every step ...
    swa_calls, ext_calls = seen[0::2], seen[1::2]
    for calls in (swa_calls, ext_calls):
        assert len(calls) == 4 and all(c == calls[0] for c in calls), calls
    # ... and owned by the scratch of that scope.
    for calls, scratch_ptrs in zip((swa_calls, ext_calls), owned[0], strict=True):
        assert set(calls[0].values()) <= set(scratch_ptrs.values())
    # Every scratch buffer stays put.
    assert all(o == owned[0] for o in owned)
    # One plan per scope and step: refreshed even when nothing was rebuilt.
    plans = fake_aiter.calls["get_mla_metadata_v1"]
    assert plans == 2 * 4, f"plan not rewritten on every step: {plans} plans, want 8"
    assert fake_aiter.calls["get_mla_metadata_info_v1"] == 2


@pytest.mark.no_tree
def test_fake_aiter_faults_on_stale_plan(fake_aiter: ModuleType) -> None:
    """The fake's contract itself: a plan written for other kv lengths is
    refused, a fresh one is served."""
    bs, topk, d = 3, 32, 64
    info = fake_aiter.get_mla_metadata_info_v1(
        bs, 1, H, FP8, FP8, is_sparse=True, fast_mode=True, num_kv_splits=256
    )
    wmd, wi, wis, ri, rfm, rpm = (torch.empty(s, dtype=t) for s, t in info)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(bs, H, d, generator=gen).to(FP8)
    kv = torch.randn(100, 1, 1, d, generator=gen).to(FP8)
    kv_indices = torch.randint(0, 100, (bs * topk,), generator=gen, dtype=torch.int32)
    qo = torch.arange(bs + 1, dtype=torch.int32)
    last = torch.ones(bs, dtype=torch.int32)

    def plan(lens: list[int]) -> torch.Tensor:
        kv_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0)], dtype=torch.int32)
        fake_aiter.get_mla_metadata_v1(
            qo, kv_indptr, last, H, 1, True, wmd, wis, wi, ri, rfm, rpm,
            page_size=1, kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1,
            fast_mode=True, max_split_per_batch=256, topk=topk,
            dtype_q=FP8, dtype_kv=FP8,
        )  # fmt: skip
        return kv_indptr

    def decode(kv_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(bs, H, d, dtype=torch.bfloat16)
        _, lse = fake_aiter.mla.mla_decode_fwd(
            q, kv, o, qo, kv_indptr, kv_indices, last, 1, 1, 1, d**-0.5,
            work_meta_data=wmd, work_indptr=wi, work_info_set=wis,
            reduce_indptr=ri, reduce_final_map=rfm, reduce_partial_map=rpm,
            return_lse=True,
        )  # fmt: skip
        return o, lse

    old = plan([30, 2, 17])
    new = torch.tensor([0, 31, 33, 50], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="stale work plan"):
        decode(new)
    o, lse = decode(old)
    for i, (a, z) in enumerate(zip(old[:-1].tolist(), old[1:].tolist(), strict=True)):
        k = kv.view(-1, d)[kv_indices[i * topk : i * topk + z - a].long()].double()
        s = q[i].double() @ k.T * d**-0.5
        torch.testing.assert_close(lse[i].double(), s.logsumexp(-1))
        ref = torch.softmax(s, -1) @ k
        torch.testing.assert_close(o[i].double(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(
    dsv4_decode: ModuleType, fake_aiter: ModuleType
) -> None:
    """Capture one decode step in a CUDA graph, replay it with new lengths
    and indices: the replay equals an eager run and the float64 reference."""
    dev = torch.device("cuda")
    d_v = 64
    static = make_step(30, *STEPS[0], device=dev)
    scratches = (dsv4_decode.AiterSparseScratch(), dsv4_decode.AiterSparseScratch())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: allocates the scratch buffers
        run_decode(dsv4_decode, static, d_v, scratches)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_decode(dsv4_decode, static, d_v, scratches)

    for n, lens in enumerate([STEPS[1], STEPS[4], STEPS[3], STEPS[0]]):
        step = make_step(40 + n, *lens, device=dev)
        for name, t in vars(step).items():
            getattr(static, name).copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        fresh = (dsv4_decode.AiterSparseScratch(), dsv4_decode.AiterSparseScratch())
        eager = run_decode(dsv4_decode, step, d_v, fresh)
        # index_add merges splits with atomics on CUDA: not bitwise.
        torch.testing.assert_close(out, eager)
        check(out, step, d_v)
