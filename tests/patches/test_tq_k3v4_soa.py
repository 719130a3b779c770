"""turboquant_k3v4_nc's pages in turboquant_soa's layout for the grouped
decode (tq-v0.33/0017).

0011 stored turboquant_soa's pages (a token's codes one aligned row, the
fp16 fields in arrays after the page's rows) for 4-bit values with FP8 or
4-bit MSE keys; 3-bit keys kept slots, where 0009's first stage 1, which
ran them then, was slower on the aligned rows. Since 0012-0016 they run the
registers stage 1, whose 3-bit codes load as 32-bit words; what
turboquant_k3v4_nc's slots still start 2-byte aligned is its 4-bit value
rows, loaded two bytes at a time and repacked, as turboquant_4bit_nc's
were before 0011. On an H200 its decode on SoA pages took 0.68-0.93x the
time on slots; turboquant_3bit_nc keeps slots (0.82-1.17x,
test_tq_soa_pages.py).

The regression test reads a page the backend stored back through both
layouts' offsets (``tqbatches.page_layout``): on the base it holds slots.
The other runs a decode step with many programs through the backend over
those pages (the registers stage 1 with both query dtypes; at head size 64
a token's row of 24 key and 32 value bytes is 8-byte aligned) in Triton's
interpreter: its largest error against float64 attention over the K/V the
cache holds at most 1.25x v0.33.0's kernel's on the same cache.
"""

from __future__ import annotations

import pytest
import torch
import tqbatches as tb

SLOTS = r"^turboquant_k3v4_nc's pages for the grouped decode hold slots"
SHAPES = [("turboquant_k3v4_nc", torch.bfloat16), ("turboquant_k3v4_nc", torch.float16)]
REQS = [tb.Req(40, 1), tb.Req(23, 1)]


# The tree's backend at head size 64 with 4 query heads a KV head.
env = tb.cases_fixture("k3v4_soa", hq=8, hk=2, head=64)


@pytest.mark.bug_signature(AssertionError, SLOTS)
@tb.env_cases(SHAPES[:1])
def test_k3v4_pages_are_soa_rows(env: tb.Backend) -> None:
    """The backend's pages, read through turboquant_soa's offsets, hold the
    slot store's records: each token's key and value codes one row, the
    fp16 fields in arrays after the page's rows."""
    impl, _, batch, slots = tb.slot_twin(env, REQS)
    cfg = impl.tq_config
    layout = tb.page_layout(batch, slots, cfg, REQS)
    if layout == "slots":
        raise AssertionError(
            f"{env.shape.preset}'s pages for the grouped decode hold slots "
            f"({cfg.slot_size}-byte records a token and head: value code rows "
            "2-byte aligned), not turboquant_soa's code rows and field arrays"
        )
    assert layout == "soa", "the backend's pages hold neither layout's records"


@tb.env_cases(SHAPES)
def test_step_as_accurate_as_v0330(env: tb.Backend) -> None:
    """A decode step's grouped decode over the backend's pages with many
    programs, against float64 attention over the K/V the cache holds: the
    registers stage 1, its largest error at most 1.25x v0.33.0's kernel's
    on the same cache (the decode accuracy suite's bound)."""
    tb.check_regs_step(env, many=True)
