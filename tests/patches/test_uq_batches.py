"""The differential test of test_tq_batches.py on UltraQuant: every batch the
scheduler can form gives every request the answer it gets alone, eager, in
a full CUDA graph replayed with new lengths, and with async host upper
bounds.

The same generated batches (``test_tq_batches``' strategies, over
UltraQuant's 64-token blocks) through UltraQuant's store kernel, metadata
builder and ``forward`` (``tqbatches``), every request's rows against
float64 attention over the K/V its FP4 + UE8M0 cache really holds
(``tqbatches.uq_dequant``; the queries of its Triton kernel rotated and
rounded to E4M3 as the format defines). On CPU UltraQuant's kernels run in
Triton's interpreter (its bf16 dot fixed by the harness), so the search is
shorter than TurboQuant's and the continuation threshold is 4 queries.

On v0.33.0 with the TurboQuant patches its short search finds, by itself,
three of the bugs tq-v0.33/0004, 0005 and 0007 fix: the replay's frozen lengths, the
host upper bound in the small continuation, the continuation without
flash-attn crashing on grouped queries; not the fast path's (a rarer batch,
which test_uq_attention.py holds). ``TQ_BATCH_EXAMPLES=N`` searches longer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tqbatches as tb
from hypothesis import given
from hypothesis import strategies as st
from test_tq_batches import (
    HOST_READ,
    HOST_UPPER_BOUND,
    IGNORES_CONTEXT,
    LONG,
    REPLAY_DIFFERS,
    Limits,
    async_batches,
    mixed_batches,
    search,
    uniform_batches,
)

Req = tb.Req
THRESHOLD = tb.THRESHOLD if LONG else 4
# Contexts long enough for prefix hits of whole 64-token blocks; fresh
# prompts are stored by the interpreted store kernel, the dearest part.
LIMITS = Limits(tb.UQ_SHAPE.block, 300 if LONG else 100, THRESHOLD)


@pytest.fixture(scope="module")
def env(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tb.Backend]:
    with pytest.MonkeyPatch.context() as mp:
        model_dir = tmp_path_factory.mktemp("tiny_qwen3")
        yield tb.open_ultraquant(vllm_tree, model_dir, mp.setattr, threshold=THRESHOLD)
        tb.close_backend()


@pytest.fixture(params=["flash-attn", "no-flash-attn"])
def attention(
    request: pytest.FixtureRequest, env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> str:
    return tb.use_attention(request.param, env, monkeypatch.setattr)


@pytest.fixture
def flash_attn(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> str:
    return tb.use_attention("flash-attn", env, monkeypatch.setattr)


@pytest.mark.bug_signature(AssertionError, IGNORES_CONTEXT)
@pytest.mark.bug_signature(
    RuntimeError, r"expanded size of the tensor \(\d+\) must match the existing size"
)
@search(examples=6)
@given(reqs=mixed_batches(LIMITS), pad=st.integers(0, 3), seed=st.integers(0, 1 << 16))
def test_uq_every_batch_matches_reference(env, attention, reqs, pad, seed) -> None:
    impl, layer = tb.new_impl(env, attention)
    batch = tb.make_batch(
        env, impl, layer, reqs, seed, pad_tokens=pad, store_context=False
    )
    meta = env.builder().build(0, batch.cam)
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)


@pytest.mark.bug_signature(AssertionError, REPLAY_DIFFERS)
@pytest.mark.bug_signature(AssertionError, HOST_READ)
@search(examples=4)
@given(batch=uniform_batches(LIMITS), seed=st.integers(0, 1 << 16))
def test_uq_graph_replay_matches_eager(env, flash_attn, batch, seed) -> None:
    reqs, pad = batch
    impl, layer = tb.new_impl(env, flash_attn)
    real = tb.make_batch(
        env, impl, layer, reqs, seed, pad_tokens=pad * reqs[0].q, pad_reqs=pad,
        store_context=False,
    )  # fmt: skip
    tb.check_replay(env, impl, layer, real, pad)


@pytest.mark.bug_signature(AssertionError, HOST_UPPER_BOUND)
@search(examples=4)
@given(batch=async_batches(LIMITS), seed=st.integers(0, 1 << 16))
def test_uq_async_host_upper_bound(env, flash_attn, batch, seed) -> None:
    reqs, over = batch
    impl, layer = tb.new_impl(env, flash_attn)
    tb.check_async(env, impl, layer, reqs, over, seed)
