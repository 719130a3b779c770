"""Targeted tests of tq-v0.33's UltraQuant patches: the prefill loop of
UltraQuant (``ultraquant_attn.py``, v0.32.0+), a subclass of the TurboQuant
backend with its own ``_prefill_attention``, which kept the bugs the
TurboQuant patches fix for TurboQuant.

- Full CUDA graphs and async spec decode (tq-v0.33/0004): the small
  continuation sliced its causal lengths from an arange by host values, which
  a graph freezes (with tq-v0.33/0002's capture metadata every replay reads
  the first few cached positions; on v0.33.0 the capture records the
  first-chunk branch) and which async scheduling overstates.
- The flash-attn fast path (tq-v0.33/0005, vllm#46460): a request with cached
  context batched with a longer fresh prompt ignores its context.
- The path without flash-attn (tq-v0.33/0007): its continuation could not run
  grouped-query models and masked top-left.

Every step runs the tree's own store kernel, metadata builder and
``forward`` (``tqbatches``); each request's rows are compared with a float64
reference over the K/V the FP4 + UE8M0 cache really holds, read back from its
bytes (``tqbatches.uq_dequant``). On CPU UltraQuant's Triton kernels (store,
dequant, unified attention) run in Triton's interpreter, whose bf16 ``tl.dot``
is fixed by ``tqharness.fix_interpreter_bf16_dot``; the continuation threshold
is lowered from 128 to 4 queries to keep them affordable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tqbatches as tb

Req = tb.Req
THRESHOLD = 4

REPLAY_DIFFERS = r"^replay differs from eager"
HOST_READ = r"^host read \S+ of a device tensor of the attention metadata"
HOST_UPPER_BOUND = r"^continuation seq_lens follow the host upper bound"
IGNORES_CONTEXT = r"^request \d+ .* ignores its cached context"
# torch's message for expand() from Hk to Hq heads.
GQA_EXPAND = r"expanded size of the tensor \(\d+\) must match the existing size"


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


# --------------------------------------------------------------------------
# tq-v0.33/0004: lengths from the device under full graphs and async
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, REPLAY_DIFFERS)
@pytest.mark.bug_signature(AssertionError, HOST_READ)
def test_uq_graph_replay_matches_eager(env, flash_attn) -> None:
    """Spec-decode verification rows (1 + 2 drafts) in a full graph captured
    on the runner's dummy values, replayed with real ones, one padding row."""
    impl, layer = tb.new_impl(env, flash_attn)
    reqs, pad = [Req(70, 3), Req(150, 3)], 1
    real = tb.make_batch(
        env, impl, layer, reqs, 40807, pad_tokens=3 * pad, pad_reqs=pad,
        store_context=False,
    )  # fmt: skip
    tb.check_replay(env, impl, layer, real, pad)


@pytest.mark.bug_signature(AssertionError, HOST_UPPER_BOUND)
def test_uq_async_spec_decode_host_upper_bound(env, flash_attn) -> None:
    """A decode, then verification rows whose host seq_len assumes drafts
    accepted that the device knows were rejected."""
    impl, layer = tb.new_impl(env, flash_attn)
    reqs = [Req(40, 1), Req(70, 3), Req(100, 4)]
    tb.check_async(env, impl, layer, reqs, {1: 2, 2: 1}, seed=40831)


# --------------------------------------------------------------------------
# tq-v0.33/0005: the flash-attn fast path, only without cached context
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, IGNORES_CONTEXT)
def test_uq_context_batched_with_longer_fresh_prompt(env, attention) -> None:
    """vllm#46460 on UltraQuant: a request with 16 cached tokens and 8 new
    (a prefix-cache hit, a later chunk) in the same step as a fresh 24-token
    prompt; both maxima are 24."""
    impl, layer = tb.new_impl(env, attention)
    reqs = [Req(0, 24), Req(16, 8)]
    batch = tb.make_batch(env, impl, layer, reqs, seed=46460, store_context=False)
    meta = env.builder().build(0, batch.cam)
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)


# --------------------------------------------------------------------------
# tq-v0.33/0007: the continuation without flash-attn
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(RuntimeError, GQA_EXPAND)
@pytest.mark.bug_signature(AssertionError, r"^request \d+ .* (differs|ignores)")
def test_uq_continuation_without_flash_attn(env, monkeypatch) -> None:
    """A continuation above the threshold (40 cached tokens, 8 new) on a
    grouped-query layer (4 query heads, 2 KV heads), without flash-attn;
    a decode and a first chunk in the same step."""
    tb.use_attention("no-flash-attn", env, monkeypatch.setattr)
    impl, layer = tb.new_impl(env, "no-flash-attn")
    reqs = [Req(30, 1), Req(40, 8), Req(0, 6)]
    batch = tb.make_batch(env, impl, layer, reqs, seed=7, store_context=False)
    meta = env.builder().build(0, batch.cam)
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)
