# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode: splits that fill whole waves.

With many programs the registers stage 1 runs one warp a program under a
register cap of 168, so an SM holds 12 of them. Its split count fills whole
waves of them instead of ending in a part-empty wave. Checked: the split
count of a decode step at the SM counts of current GPUs leaves less than
one split's programs of the waves its grid takes empty.
"""

import importlib
import math

import pytest
import torch

GROUPED = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


@pytest.mark.parametrize("sms", [108, 132, 148])
@pytest.mark.parametrize(
    "num_kv_heads,batch", [(4, 32), (4, 128), (8, 64), (2, 100), (1, 200)]
)
def test_splits_fill_whole_waves(monkeypatch, sms, num_kv_heads, batch):
    gd = importlib.import_module(GROUPED)
    monkeypatch.setattr(gd, "_num_sms", lambda device: sms)
    splits = gd.grouped_decode_num_splits(
        batch, num_kv_heads, 256 * 32 // batch, torch.device("cpu"), True
    )
    programs, wave = batch * num_kv_heads, 12 * sms
    slots = math.ceil(programs * splits / wave) * wave
    assert slots - programs * splits < programs, (
        f"{splits} splits for {batch} requests x {num_kv_heads} KV heads on "
        f"{sms} SMs leave {slots - programs * splits} of the {slots} program "
        f"slots of their waves empty"
    )
    assert programs * splits > wave, f"{splits} splits: one wave or less"
