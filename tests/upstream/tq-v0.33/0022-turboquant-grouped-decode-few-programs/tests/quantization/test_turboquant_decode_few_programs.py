# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode with fewer programs than half the SMs.

Small batches take the registers stage 1's launch of large ones (one warp a
program under a register cap of 168, 12 of them an SM) with splits that
fill one whole wave of them. Checked: the split count of a decode step at
the SM counts of current GPUs fills one wave but for less than one split's
programs, and the count of a preset off the registers stage 1 is kept.
"""

import importlib
import math

import pytest
import torch

GROUPED = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


@pytest.mark.parametrize("sms", [108, 132, 148])
@pytest.mark.parametrize("num_kv_heads,batch", [(4, 1), (4, 8), (8, 4), (1, 1), (2, 3)])
def test_few_programs_fill_one_wave(monkeypatch, sms, num_kv_heads, batch):
    gd = importlib.import_module(GROUPED)
    monkeypatch.setattr(gd, "_num_sms", lambda device: sms)
    device = torch.device("cpu")
    splits = gd.grouped_decode_num_splits(
        batch, num_kv_heads, 256 * 32 // batch, device, True
    )
    programs, wave = batch * num_kv_heads, 12 * sms
    assert 0 <= wave - programs * splits < programs, (
        f"{splits} splits for {batch} requests x {num_kv_heads} KV heads on "
        f"{sms} SMs fill {programs * splits} of the {wave} program slots of "
        f"one wave"
    )
    kept = gd.grouped_decode_num_splits(batch, num_kv_heads, 8192, device, False)
    assert kept == min(8192, math.ceil(8 * sms / programs))
