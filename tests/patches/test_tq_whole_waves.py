"""Split counts that fill whole waves of the registers stage 1 (tq-v0.33/0020).

With many (request, KV head) programs the registers stage 1 runs one warp
a program under a register cap of 168: an SM holds 12 of them (64K
registers), a wave is 12 x SMs programs. The split count aimed at 16
programs a SM (cdiv(16 x SMs, requests x KV heads)), so the grid ended in
a part-empty wave: 32 requests x 4 KV heads on an H100's 132 SMs made 17
splits, 2,176 programs, 1.37 waves (ncu: 9.1 of 12 warps a SM achieved),
and the last wave ran the GPU a third full for a whole program's time.
The patch fills whole waves (six of them, or as many as max_splits
allows, so a served batch's long requests are not the tail alone): on an
H200 0.81-0.96x the time with equal lengths and 0.74-0.81x with mixed
ones (ci/gpu/NOTES.md).

The regression test asks the split count the backend takes for a decode
step (its host sizes, the reservation of 256 requests x 32 splits) at
the GPUs' SM counts: the waves its grid takes must be full but for less
than one split's programs (another split would take another wave), also
where the reservation caps the count (200 requests x 1 KV head). The
others check what stays: fewer programs keep 8 a SM, the count stays in
[1, max_splits] and depends on host sizes only.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import tqbatches as tb

PART_EMPTY = r"^\d+ splits for \d+ requests x \d+ KV heads on \d+ SMs leave \d+ of"
RESIDENT = tb.REGS_RESIDENT
splits = tb.step_splits
# (SMs, KV heads, requests): H100 and H200 (132), A100 (108), B200 (148);
# requests x KV heads up to half a wave, where the grid has splits to choose.
MANY = [(132, 4, 32), (132, 4, 64), (132, 4, 128), (132, 8, 32), (132, 2, 100),
        (132, 1, 200), (108, 4, 32), (108, 8, 64), (148, 4, 48),
        (148, 8, 64)]  # fmt: skip


@pytest.mark.bug_signature(AssertionError, PART_EMPTY)
@pytest.mark.parametrize("sms,kv_heads,requests", MANY)
def test_splits_fill_whole_waves(
    gd: Any, monkeypatch: pytest.MonkeyPatch, sms: int, kv_heads: int, requests: int
) -> None:
    """With many programs the registers stage 1's grid leaves less than one
    split's programs of the waves it takes empty, and takes more than one."""
    monkeypatch.setattr(gd, "_num_sms", lambda device: sms)
    s = splits(gd, requests, kv_heads)
    programs, wave = requests * kv_heads, RESIDENT * sms
    waves = programs * s / wave
    slots = math.ceil(waves) * wave
    if slots - programs * s >= programs:
        raise AssertionError(
            f"{s} splits for {requests} requests x {kv_heads} KV heads on {sms} "
            f"SMs leave {slots - programs * s} of the {slots} program slots of "
            f"their waves empty ({waves:.2f} waves of the {RESIDENT} programs a "
            f"SM the register cap leaves)"
        )
    assert waves >= 1.5, f"{s} splits: {waves:.2f} waves, not several"


def test_few_programs_keep_their_splits(
    gd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer programs than ``_many_programs`` (uncapped), or a preset off the
    registers stage 1: 8 programs a SM, as before (from tq-v0.33/0022 fewer
    programs fill one wave: test_tq_few_programs.py)."""
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    if not hasattr(gd, "_REGS_FEW_WAVES"):
        assert splits(gd, 8, 4) == math.ceil(8 * 132 / 32)
    assert splits(gd, 32, 4, in_registers=False) == math.ceil(8 * 132 / 128)


def test_splits_within_bounds_from_host_sizes(
    gd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At least one split, at most ``max_splits``, the same count for the
    same sizes (a captured graph replays the launch)."""
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    assert gd.grouped_decode_num_splits(32, 4, 5, tb.DEVICE, True) == 5
    assert gd.grouped_decode_num_splits(1 << 16, 8, 64, tb.DEVICE, True) == 1
    counts = [splits(gd, b, 4) for b in (33, 64, 128, 256)]
    assert counts == [splits(gd, b, 4) for b in (33, 64, 128, 256)]
    assert counts == sorted(counts, reverse=True)
