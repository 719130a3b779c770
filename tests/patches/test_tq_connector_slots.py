"""TurboQuant pages where a KV connector moves them (tq-v0.33/0021).

tq-v0.33/0011 and 0017 store turboquant_soa's pages on CUDA where the
grouped decode reads them faster (4-bit values: turboquant_4bit_nc, k8v4,
k3v4_nc). A page is the same bytes either way but not the same meaning: a
KV connector (disaggregated prefill and decode, LMCache, Mooncake, an
offloading tier shared by instances) hands its bytes to a process whose
CUDA store writes v0.33.0's slots, and that process decodes them as
slots. The patch keeps slots wherever a KV connector is configured.

The regression test stores a context and a decode step through the
backend under a connector (one case per KV role, each preset once) and
decodes the pages as such a peer does, with v0.33.0's kernel, which reads
slots: on the base its output is garbage against float64 attention over
the K/V stored; patched it is at the backend's own error. The backend's
own forward over those pages stays at its bound. Without a connector the
pages stay SoA (test_tq_soa_pages.py).

Small shapes: on CPU every Triton kernel runs in the interpreter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import tqbatches as tb

PEER = r"^a peer whose CUDA store writes slots decodes the pages"
CASES = [  # (preset, KV role): each preset and each role once
    ("turboquant_4bit_nc", "kv_both"),
    ("turboquant_k8v4", "kv_producer"),
    ("turboquant_k3v4_nc", "kv_consumer"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0][11:]}-{c[1]}")
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a GQA model the grouped decode takes (Hq 4,
    Hk 2, D 64) with a KV connector configured."""
    preset, role = request.param
    shape = tb.Shape(hq=4, hk=2, head=64, preset=preset)
    connector = {"kv_connector": "ExampleConnector", "kv_role": role}
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"connector_{role}",
        kv_transfer_config=connector,
    )  # fmt: skip


@pytest.mark.bug_signature(AssertionError, PEER)
def test_connector_peer_decodes_the_pages(env: tb.Backend) -> None:
    """A decode step of three requests stored by the backend under a KV
    connector, decoded by v0.33.0's kernel from the bytes as they are (a
    peer's reading), is within 1.25x the error of the same kernel reading
    the pages in the layout the backend stored (the decode accuracy suite's
    bound), against float64 attention over the K/V stored."""
    impl, layer, batch = tb.decode_batch(env, [200, 77, 16], seed=12)
    want = torch.cat(tb.reference(batch, impl, layer))
    sent = dataclasses.replace(batch, soa=False)  # the bytes, read as slots
    peer, right = (tb.decode_kernels(impl, layer, b, splits=2, grouped=False)[0]
                   for b in (sent, batch))  # fmt: skip
    err, right_err = ((x.double().cpu().view_as(want) - want).abs().max().item()
                      for x in (peer, right))  # fmt: skip
    if not err <= 1.25 * right_err:  # NaN too
        raise AssertionError(
            "a peer whose CUDA store writes slots decodes the pages this "
            f"process stored with a KV connector ({env.shape.preset}) "
            f"{err:.3g} off float64 attention, against {right_err:.3g} read "
            "in their own layout"
        )


def test_backend_decodes_its_connector_pages(env: tb.Backend) -> None:
    """The backend's own forward over the pages it stored under the
    connector is within the output dtype's rounding of float64 attention
    (two roundings: the kernel's fp32 sums)."""
    _, got, want = tb.decode_step(env)
    err = (got - want).abs().max().item()
    assert err <= 2 * tb.half_ulp(env.shape.dtype, want), f"max |error| = {err:.3g}"
