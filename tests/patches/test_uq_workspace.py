"""Targeted tests of tq-v0.33/0007: UltraQuant's continuation prefill walks
the cached context in tiles of the workspace the metadata builder reserves
(tq-v0.33/0001's design), with no per-layer buffer.

On v0.32.0 / v0.33.0 a continuation of more than 128 new tokens took K/V
buffers of the whole cached context from the shared workspace (reserved by
the builder only with chunked prefill on: otherwise, once the workspace is
locked, "Workspace is locked but allocation from
'ultraquant_attn.py:...:_ultraquant_continuation_prefill' requires ...",
vllm#41726's signature), and hung copies of the whole context on the layer,
sized by the block table's width (max_model_len): outside the memory
profile, the workspace and its lock.

As the runner: workspace manager, impl, metadata builder (its reservation),
a decode warm-up, ``lock_workspace()``, then continuations with the block
table as wide as the runner's (max_model_len). The continuation threshold is
lowered to 4 queries and the tile to 64 tokens (one UltraQuant block) to walk
several tiles in Triton's interpreter. Every row is checked against float64
attention over the K/V the cache holds (``tqbatches``), also with a head_dim
above 256 (which ROCm's flash-attn lacks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import tqbatches as tb
import tqharness as h

Req = tb.Req
THRESHOLD = 4
TILE = 64
LOCKED_WORKSPACE = (
    r"Workspace is locked but allocation from .*_ultraquant_continuation_prefill"
)


@pytest.fixture
def open_env(
    vllm_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """UltraQuant under a config of the test's (``**config`` of
    ``tqharness.make_vllm_config``), its continuation tile shrunk to TILE
    tokens before the impl and the builder read it (the tile's bounds are
    tq-v0.33/0001's constants)."""
    opened = []

    def open_(shape: tb.Shape = tb.UQ_SHAPE, **config: Any) -> tb.Backend:
        h.shrink_continuation_tile(h.tq_module(), TILE, monkeypatch.setattr)
        backend = tb.open_ultraquant(
            vllm_tree, tmp_path, monkeypatch.setattr, shape, THRESHOLD, **config
        )
        opened.append(backend)
        return backend

    yield open_
    if opened:
        tb.close_backend()


def runner_width(backend: tb.Backend, batch: tb.Batch) -> None:
    """The block table as the runner passes it: max_model_len wide."""
    table = batch.cam.block_table_tensor
    width = backend.shape.max_model_len // backend.shape.block
    wide = table.new_zeros(table.shape[0], width)
    wide[:, : table.shape[1]] = table
    batch.cam = h.cam_replace(batch.cam, block_table_tensor=wide)


def step(backend: tb.Backend, impl: Any, layer: Any, reqs: list[Req], seed: int):
    """One eager step of ``reqs`` (context written into the cache, block
    table as wide as the runner's): the batch and its output."""
    batch = tb.make_batch(backend, impl, layer, reqs, seed, store_context=False)
    runner_width(backend, batch)
    meta = backend.builder().build(0, batch.cam)
    return batch, tb.run_step(impl, layer, batch, meta)


def held_tensors(*owners: Any) -> dict[str, tuple[int, int]]:
    """Tensors held by the impl and the layer: (data_ptr, bytes) by name."""
    found = {}
    for who, obj in zip(("impl", "layer"), owners):
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                found[f"{who}.{name}"] = (value.data_ptr(), nbytes)
    return found


# --------------------------------------------------------------------------
# Regression: the workspace after lock, per-layer buffers
# --------------------------------------------------------------------------


@pytest.mark.bug_signature(AssertionError, LOCKED_WORKSPACE)
@pytest.mark.bug_signature(AssertionError, r"^workspace reallocated")
@pytest.mark.bug_signature(
    AssertionError, r"^per-layer buffers (created|reallocated) after lock"
)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_uq_continuation_prefill_after_workspace_lock(
    open_env, monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    """vllm#41726 on UltraQuant: a continuation over 5 tiles of context after
    lock_workspace(), chunked prefill on (the builder reserves the whole
    context for it upstream) and off (nothing upstream: a prefix-cache or
    KV-connector hit, a resumed request), with flash-attn's code paths."""
    from vllm.v1.worker import workspace

    env = open_env(
        max_num_batched_tokens=256 if chunked else None,
        enable_chunked_prefill=chunked,
    )
    tb.use_attention("flash-attn", env, monkeypatch.setattr)
    impl, layer = tb.new_impl(env, "flash-attn")
    step(env, impl, layer, [Req(31, 1), Req(7, 1)], seed=0)  # decode warm-up
    before = held_tensors(impl, layer)
    manager = workspace.current_workspace_manager()
    reserved = manager._current_workspaces[0]
    workspace.lock_workspace()

    context = 5 * TILE - 3
    batch, out = step(env, impl, layer, [Req(20, 1), Req(context, 6)], seed=1)
    tb.check_rows(out, batch, impl, layer)
    assert manager._current_workspaces[0] is reserved, "workspace reallocated"
    # Context-sized: a K or V row per cached token (Hk x D bf16).
    row = env.shape.hk * env.shape.head * 2
    after = held_tensors(impl, layer)
    big = {n: b for n, (_, b) in after.items() if b >= row * context}
    new = [f"{n} ({b // row} rows)" for n, b in big.items() if n not in before]
    assert not new, (
        f"per-layer buffers created after lock: {', '.join(new)}, "
        f"max_model_len {env.shape.max_model_len}, context {context}"
    )
    changed = sorted(n for n in big if n in before and after[n] != before[n])
    assert not changed, f"per-layer buffers reallocated after lock: {changed}"


@pytest.mark.bug_signature(AssertionError, r"^temporaries grow with the context")
@pytest.mark.bug_signature(AssertionError, r"^a flash-attn call spans more than")
@pytest.mark.parametrize("attention", ["flash-attn", "no-flash-attn"])
def test_uq_continuation_temporaries_bounded_by_tile(
    open_env, monkeypatch: pytest.MonkeyPatch, attention: str
) -> None:
    """No tensor made during a continuation grows with its context: two
    contexts (2 and 6 tiles, the same partial last tile), every storage the
    longer one allocates at least a K row per cached token of the shorter
    has a size the shorter also allocates; no flash-attn call spans more
    than a tile."""
    env = open_env(max_num_batched_tokens=256)
    fake = tb.use_attention(attention, env, monkeypatch.setattr)
    stand_in = env.tq.flash_attn_varlen_func if fake == "flash-attn" else None
    impl, layer = tb.new_impl(env, attention)
    q_len, sizes = THRESHOLD + 2, {}
    for context in (2 * TILE + 5, 6 * TILE + 5):
        spied: list[set[int]] = []

        def run(context=context, spied=spied) -> None:
            batch = tb.make_batch(
                env, impl, layer, [Req(context, q_len)], context, store_context=False
            )
            runner_width(env, batch)
            meta = env.builder().build(0, batch.cam)
            spied.append(
                h.new_storage_sizes(lambda: tb.run_step(impl, layer, batch, meta))
            )

        run()
        sizes[context] = spied[0]
    (small, s_sizes), (large, l_sizes) = sizes.items()
    row = env.shape.hk * env.shape.head * 2
    grown = sorted(n for n in l_sizes - s_sizes if n >= row * small)
    assert not grown, (
        f"temporaries grow with the context: sizes {grown} appear only at "
        f"context {large} (largest at {small}: {max(s_sizes)})"
    )
    if isinstance(stand_in, h.ReferenceFlashAttn):
        assert max(stand_in.k_lens) <= max(TILE, q_len), (
            f"a flash-attn call spans more than a tile: keys {stand_in.k_lens}"
        )


# --------------------------------------------------------------------------
# The tiles against float64 attention, head_dim 512 too
# --------------------------------------------------------------------------


D512 = dataclasses.replace(tb.UQ_SHAPE, hq=2, hk=1, head=512, max_model_len=512)
CASES = {
    # name: (shape, attention, requests)
    "flash-attn": (None, "flash-attn", [(20, 1), (3 * TILE + 5, 6)]),
    "no-flash-attn": (None, "no-flash-attn", [(3 * TILE + 5, 6)]),
    "head-512": (D512, "flash-attn", [(2 * TILE + 5, 6)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_uq_tiled_continuation_matches_reference(
    open_env, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Continuations over several tiles (and a decode in the same step)
    against float64 attention: flash-attn's code paths or not; head_dim 512
    (ROCm's flash-attn has none: the tiles go through PyTorch, as they did
    through vLLM's Triton unified_attention over a whole-context copy)."""
    shape, attention, reqs = CASES[case]
    env = open_env(shape or tb.UQ_SHAPE, max_num_batched_tokens=256)
    tb.use_attention(attention, env, monkeypatch.setattr)
    impl, layer = tb.new_impl(env, attention)
    batch, out = step(env, impl, layer, [Req(*r) for r in reqs], seed=11)
    tb.check_rows(out, batch, impl, layer)
