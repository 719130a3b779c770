"""Differential test of the TurboQuant attention backend: every batch the
scheduler can form gives every request the answer it gets alone.

Batches are generated (``hypothesis``), not hand-picked: decodes first, then
fresh prompts, chunked continuations on both sides of the 128-token
threshold, spec-decode verification rows of 1 + k tokens, prefix-cache hits
that share blocks with another row, and the padding the runner adds for CUDA
graphs. Each runs through the tree's own store kernel, metadata builder and
``forward`` (``tqbatches``), and every request's rows are compared with a
float64 reference over the K/V the cache really holds, read back from its
bytes (``tqbatches.reference``): a row's answer depends on its own
(cached, q) alone, never on the rest of the batch.

Three modes, as the runner drives the backend:

* eager steps (``test_every_batch_matches_reference``), with flash-attn's
  code paths (vLLM's kernel where the tree has it, a float64 stand-in on
  CPU) and without them;
* full CUDA graphs (``test_graph_replay_matches_eager``): uniform batches
  (decodes, or verification rows of 1 + k), metadata built with
  ``build_for_cudagraph_capture`` from the runner's dummy values and run
  with the device tensors unreadable on the host (a host read would crash
  the capture), then the device buffers refilled with a real batch and run
  again with the capture-time host values, as a replay does: bit-identical
  to an eager step, and right;
* async scheduling (``test_async_host_upper_bound``): the host knows only
  an upper bound of the seq_lens of rows whose drafts were partly rejected;
  the output must not change (bit-identical) and must be right; and both
  at once (``test_async_graph_replay``): a replay whose step has host
  upper bounds equals an eager step with exact ones.

Continuations walk their context in 2-3 tiles (the tile shrunk to one
block). Decode steps of 8-32 rows run in full graphs
(``test_decode_steps_of_8_to_32_rows``), and eager steps and wide decode
steps run again at a second shape set as deployed (``WIDE``: GQA 4, head
size 128, bf16, k8v4 and 3bit_nc, a 16-token block and a 48-token one).

A failure names the request, its batch (minimized by hypothesis) and the
error, and says what the row did where that can be told: a row with cached
context that matches attention over its own new tokens alone "ignores its
cached context" (vllm#46460).

Found on the unpatched bases without a case written for them: #46460 (eager,
flash-attn paths, v0.20.2 and v0.33.0), capture of the first-chunk branch
(graph replay, v0.21.0+), the host upper bound in the small continuation
(async, v0.21.0+), host reads under capture (graph, v0.20.x: #40807).

CI runs a bounded, fixed-seed search (``derandomize``, no example
database, a failure shrunk for at most ``conftest.SHRINK_SECONDS``; its
cost is in docs/testing.md); ``TQ_BATCH_EXAMPLES=N`` sets the examples per
test for a longer hand run. Tolerance: ``tqbatches.tolerance``, by the
model's dtype (how it is derived is written there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import tqbatches as tb
import tqharness as h
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

Req = tb.Req
SHAPE = tb.Shape()
BLOCK = SHAPE.block
LONG = int(os.environ.get("TQ_BATCH_EXAMPLES", "0"))
# In Triton's interpreter a chunk with context that takes the decode kernel
# costs per query and per KV split (the continuation launches the kernel with
# the launcher's default of 32 splits), so CI lowers the continuation
# threshold (the number of queries up to which a chunk takes that kernel)
# from 128 to 4, launches it with 4 splits and keeps contexts short; the long
# mode runs the tree's own threshold and splits.
THRESHOLD = tb.THRESHOLD if LONG else 4
SPLITS = 4
MAX_CACHED = 300 if LONG else 48  # the model's max_model_len: 512
# The second shape set, as deployed: GQA 4, head size 128, bf16, the
# k8v4 and 3bit_nc presets, a 16-token block and a block of 48 (a hybrid
# model's block is a multiple of 16 that need not be a power of two).
WIDE = {
    "k8v4-d128": tb.Shape(
        hq=4, hk=1, head=128, preset="turboquant_k8v4", dtype=torch.bfloat16
    ),
    "3bit_nc-d128-block48": tb.Shape(
        hq=4,
        hk=1,
        head=128,
        block=48,
        preset="turboquant_3bit_nc",
        dtype=torch.bfloat16,
    ),
}

# How each bug shows.
IGNORES_CONTEXT = r"^request \d+ .* ignores its cached context"
REPLAY_DIFFERS = r"^replay differs from eager"
HOST_UPPER_BOUND = r"^continuation seq_lens follow the host upper bound"
HOST_READ = r"^host read \S+ of a device tensor of the attention metadata"


def search(examples: int) -> Any:
    """A bounded search (fixed seed, no example database: conftest's
    profile), one (the smallest) failure reported."""
    return settings(
        max_examples=LONG or examples,
        deadline=None,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


def opened(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory, shape: tb.Shape
) -> Iterator[tb.Backend]:
    """The tree's backend at ``shape``, its continuation tile shrunk to one
    block (a continuation walks 2-3 tiles) and its threshold CI's."""
    with pytest.MonkeyPatch.context() as mp:
        model_dir = tmp_path_factory.mktemp("tiny_qwen3")
        backend = tb.open_backend(vllm_tree, model_dir, shape, mp.setattr)
        h.shrink_continuation_tile(backend.tq, shape.block, mp.setattr)
        mp.setattr(backend.tq, "_CONTINUATION_DECODE_THRESHOLD", THRESHOLD)
        if not LONG:
            tb.small_continuation_splits(backend.tq, SPLITS, mp.setattr)
        yield backend
        tb.close_backend()


@pytest.fixture(scope="module")
def env(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tb.Backend]:
    yield from opened(vllm_tree, tmp_path_factory, SHAPE)


@pytest.fixture(scope="module", params=list(WIDE))
def wide_env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    yield from opened(vllm_tree, tmp_path_factory, WIDE[request.param])


@pytest.fixture(params=["flash-attn", "no-flash-attn"])
def attention(
    request: pytest.FixtureRequest, env: tb.Backend, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The backend's flash-attn code paths on or off. Where the tree has no
    vLLM flash-attn (CPU), a float64 stand-in takes the kernel's place."""
    return tb.use_attention(request.param, env, monkeypatch.setattr)


@pytest.fixture
def flash_attn(env: tb.Backend, monkeypatch: pytest.MonkeyPatch) -> str:
    """The flash-attn code paths (CUDA's default) alone: for batches whose
    rows all have context, which take the same kernels either way."""
    return tb.use_attention("flash-attn", env, monkeypatch.setattr)


# --------------------------------------------------------------------------
# Batches the scheduler forms
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the generated batches range over: the KV block size (prefix
    hits share whole blocks), the longest cached context, the continuation
    threshold (chunks are drawn on both sides of it)."""

    block: int
    max_cached: int
    threshold: int

    def cached(self) -> Any:
        return st.integers(1, self.max_cached)

    def decode(self) -> Any:
        return st.builds(Req, self.cached(), st.just(1))

    def fresh_prompt(self) -> Any:
        return st.builds(Req, st.just(0), st.integers(2, self.max_cached))

    def continuation(self) -> Any:
        return st.builds(Req, self.cached(), st.integers(2, 2 * self.threshold))

    def verification(self) -> Any:
        return st.builds(Req, self.cached(), st.integers(2, 4))  # 1 + k drafts


LIMITS = Limits(BLOCK, MAX_CACHED, THRESHOLD)


@st.composite
def with_prefix_hits(draw: Any, reqs: list[Req], block: int) -> list[Req]:
    """Some rows turned into prefix-cache hits: their first cached blocks
    are another row's (one that is no hit itself and has cached them)."""
    links = draw(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=2))
    for a, b in links:
        i, j = a % len(reqs), b % len(reqs)
        most = min(reqs[i].cached, reqs[j].cached) // block
        targets = {r.prefix[0] for r in reqs if r.prefix is not None}
        if i == j or most == 0 or reqs[j].prefix or reqs[i].prefix or i in targets:
            continue
        n = draw(st.integers(1, most))
        reqs[i] = Req(reqs[i].cached, reqs[i].q, prefix=(j, n))
    return reqs


@st.composite
def mixed_batches(draw: Any, lim: Limits = LIMITS) -> list[Req]:
    """Any step: decodes first, then first chunks, continuations and
    verification rows in any order, some sharing prefix blocks. A first
    chunk is sometimes exactly as long as the step's longest sequence: the
    boundary where the longest query is the longest sequence."""
    decodes = draw(st.lists(lim.decode(), max_size=3))
    rest = draw(
        st.lists(
            st.one_of(lim.fresh_prompt(), lim.continuation(), lim.verification()),
            min_size=1,
            max_size=3,
        )
    )
    fresh = [i for i, r in enumerate(rest) if r.cached == 0]
    if fresh and draw(st.booleans()):
        i = draw(st.sampled_from(fresh))
        rest[i] = Req(0, max(r.seq for r in decodes + rest))
    return draw(with_prefix_hits(decodes + rest, lim.block))


@st.composite
def uniform_batches(draw: Any, lim: Limits = LIMITS) -> tuple[list[Req], int]:
    """What full CUDA graphs are replayed for: every row a decode or a
    verification of the same 1 + k tokens, and the rows the runner pads
    the batch with up to the graph's size."""
    q = draw(st.integers(1, 4))
    reqs = draw(
        st.lists(st.builds(Req, lim.cached(), st.just(q)), min_size=1, max_size=3)
    )
    return draw(with_prefix_hits(reqs, lim.block)), draw(st.integers(0, 2))


@st.composite
def async_batches(draw: Any, lim: Limits = LIMITS) -> tuple[list[Req], dict[int, int]]:
    """Async spec decode: decodes and verification rows (then chunked
    continuations); rows whose drafts were partly rejected have a host
    seq_len up to k past the device one."""
    k = draw(st.integers(1, 3))
    decodes = draw(st.lists(lim.decode(), max_size=2))
    spec = draw(
        st.lists(
            st.builds(Req, lim.cached(), st.integers(2, 1 + k)), min_size=1, max_size=3
        )
    )
    rest = draw(st.lists(lim.continuation(), max_size=1))
    reqs = draw(with_prefix_hits(decodes + spec + rest, lim.block))
    rows = st.sampled_from(range(len(decodes), len(decodes) + len(spec)))
    over = draw(st.dictionaries(rows, st.integers(1, k), min_size=1))
    return reqs, over


def limits(shape: tb.Shape) -> Limits:
    """A shape's batches: contexts of at least 3 blocks (3 tiles)."""
    return Limits(shape.block, max(MAX_CACHED, 3 * shape.block), THRESHOLD)


@st.composite
def wide_decodes(draw: Any, lim: Limits = LIMITS) -> tuple[list[Req], int]:
    """A full graph's decode step of 8-32 rows, padded up to the runner's
    capture size (a multiple of 8)."""
    reqs = draw(st.lists(lim.decode(), min_size=8, max_size=32))
    return draw(with_prefix_hits(reqs, lim.block)), -len(reqs) % 8


@st.composite
def async_uniform_batches(
    draw: Any, lim: Limits = LIMITS
) -> tuple[list[Req], dict[int, int], int]:
    """Async spec decode in a full graph: every row verifies 1 + k tokens,
    some rows' host seq_lens up to k past the device's, padding rows."""
    k = draw(st.integers(1, 3))
    reqs = draw(
        st.lists(st.builds(Req, lim.cached(), st.just(1 + k)), min_size=1, max_size=4)
    )
    reqs = draw(with_prefix_hits(reqs, lim.block))
    rows = st.integers(0, len(reqs) - 1)
    over = draw(st.dictionaries(rows, st.integers(1, k), min_size=1))
    return reqs, over, draw(st.integers(0, 2))


# --------------------------------------------------------------------------
# The tolerance actually needed
# --------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def report_worst(request: pytest.FixtureRequest) -> Iterator[None]:
    """The long mode prints the largest error of a row that passed (with
    pytest's capture off: a teardown's output is shown on failure only)."""
    yield
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if LONG and capture is not None:
        with capture.global_and_fixture_disabled():
            print(
                f"\ntest_tq_batches: largest |out - reference| of a passing "
                f"row: {tb.WORST['error']:.3g} (tolerance {tb.TOLERANCE} fp16, "
                f"{tb.BF16_TOLERANCE} bf16)"
            )


# --------------------------------------------------------------------------
# Eager steps
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, IGNORES_CONTEXT)
@search(examples=20)
@given(reqs=mixed_batches(), pad=st.integers(0, 3), seed=st.integers(0, 1 << 16))
def test_every_batch_matches_reference(env, attention, reqs, pad, seed) -> None:
    """Eager steps of any batch (``pad`` tokens padded for a piecewise
    graph: they reach the cache update, not the metadata), with the
    metadata's device tensors unreadable on the host (a sync)."""
    impl, layer = tb.new_impl(env, attention)
    batch = tb.make_batch(
        env, impl, layer, reqs, seed, pad_tokens=pad, store_context=False
    )
    meta = env.builder().build(0, tb.watched(batch.cam))
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)


@pytest.mark.bug_signature(AssertionError, IGNORES_CONTEXT)
@pytest.mark.parametrize("order", ["fresh-first", "hit-first"])
def test_prefix_hit_batched_with_longer_fresh_prompt(env, attention, order) -> None:
    """vllm#46460 as users met it: a prefix-cache hit (32 cached tokens, 16
    new) in the same step as a fresh 48-token prompt, in either order. Both
    maxima are 48, which the flash-attn fast path read as "no request has
    cached context"."""
    impl, layer = tb.new_impl(env, attention)
    reqs = [Req(0, 48), Req(32, 16)]
    if order == "hit-first":
        reqs.reverse()
    batch = tb.make_batch(env, impl, layer, reqs, seed=46460)
    meta = env.builder().build(0, batch.cam)
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)


# --------------------------------------------------------------------------
# Full CUDA graphs: captured on dummy values, replayed with real ones
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, REPLAY_DIFFERS)
@pytest.mark.bug_signature(AssertionError, HOST_READ)
@search(examples=8)
@given(batch=uniform_batches(), seed=st.integers(0, 1 << 16))
def test_graph_replay_matches_eager(env, flash_attn, batch, seed) -> None:
    reqs, pad = batch
    impl, layer = tb.new_impl(env, flash_attn)
    real = tb.make_batch(
        env,
        impl,
        layer,
        reqs,
        seed,
        pad_tokens=pad * reqs[0].q,
        pad_reqs=pad,
        store_context=False,
    )
    tb.check_replay(env, impl, layer, real, pad)


# --------------------------------------------------------------------------
# Async scheduling: host seq_lens are an upper bound
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, HOST_UPPER_BOUND)
@search(examples=8)
@given(batch=async_batches(), seed=st.integers(0, 1 << 16))
def test_async_host_upper_bound(env, flash_attn, batch, seed) -> None:
    reqs, over = batch
    impl, layer = tb.new_impl(env, flash_attn)
    tb.check_async(env, impl, layer, reqs, over, seed)


@search(examples=6)
@given(batch=async_uniform_batches(), seed=st.integers(0, 1 << 16))
def test_async_graph_replay(env, flash_attn, batch, seed) -> None:
    """Async scheduling with full CUDA graphs: a replay whose step has host
    seq_lens upper bounds equals an eager step with exact ones, bit for bit,
    and is right."""
    reqs, over, pad = batch
    impl, layer = tb.new_impl(env, flash_attn)
    padded = {"pad_tokens": pad * reqs[0].q, "pad_reqs": pad, "store_context": False}
    real = tb.make_batch(env, impl, layer, reqs, seed, optimistic=over, **padded)
    exact = tb.make_batch(env, impl, layer, reqs, seed, **padded)
    tb.check_replay(env, impl, layer, real, pad, exact=exact)


# --------------------------------------------------------------------------
# Wider batches and the second shape set
# --------------------------------------------------------------------------


def replay_decodes(backend: tb.Backend, batch: tuple[list[Req], int], seed: int):
    reqs, pad = batch
    impl, layer = tb.new_impl(backend, "flash-attn")
    real = tb.make_batch(
        backend,
        impl,
        layer,
        reqs,
        seed,
        pad_tokens=pad,
        pad_reqs=pad,
        store_context=False,
    )
    tb.check_replay(backend, impl, layer, real, pad)


@search(examples=3)
@given(batch=wide_decodes(), seed=st.integers(0, 1 << 16))
def test_decode_steps_of_8_to_32_rows(env, flash_attn, batch, seed) -> None:
    """Decode steps as a server at 8-32 concurrent requests forms them, in
    a full graph: replay equals eager bit for bit, and every row is right."""
    replay_decodes(env, batch, seed)


@search(examples=6)
@given(data=st.data(), pad=st.integers(0, 3), seed=st.integers(0, 1 << 16))
def test_every_batch_at_wide_shapes(wide_env, monkeypatch, data, pad, seed) -> None:
    """``test_every_batch_matches_reference`` at the second shape set
    (``WIDE``), flash-attn's code paths, contexts of up to 3 blocks."""
    attention = tb.use_attention("flash-attn", wide_env, monkeypatch.setattr)
    impl, layer = tb.new_impl(wide_env, attention)
    reqs = data.draw(mixed_batches(limits(wide_env.shape)), label="reqs")
    batch = tb.make_batch(
        wide_env, impl, layer, reqs, seed, pad_tokens=pad, store_context=False
    )
    meta = wide_env.builder().build(0, tb.watched(batch.cam))
    tb.check_rows(tb.run_step(impl, layer, batch, meta), batch, impl, layer)


@search(examples=2)
@given(data=st.data(), seed=st.integers(0, 1 << 16))
def test_decode_steps_at_wide_shapes(wide_env, monkeypatch, data, seed) -> None:
    """``test_decode_steps_of_8_to_32_rows`` at the second shape set."""
    tb.use_attention("flash-attn", wide_env, monkeypatch.setattr)
    batch = data.draw(wide_decodes(limits(wide_env.shape)), label="batch")
    replay_decodes(wide_env, batch, seed)
