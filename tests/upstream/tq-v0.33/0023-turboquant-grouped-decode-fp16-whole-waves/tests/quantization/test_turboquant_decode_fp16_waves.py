# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant's grouped decode with fp16 queries on MSE keys.

Up to head size 128 they take the registers stage 1 at every batch, as bf16
queries do: one warp a program under a register cap of 168 (12 of them an
SM), with splits that fill whole waves of them. Checked: the split count of
a decode step at an H100's SM count fills whole waves but for less than
one split's programs; head size 256 keeps its launches.
"""

import importlib

import pytest
import torch

GROUPED = "vllm.v1.attention.ops.triton_turboquant_grouped_decode"


@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 4), (128, 8), (64, 16)])
@pytest.mark.parametrize("mse_bits,value_bits", [(4, 4), (3, 4), (3, 3)])
@pytest.mark.parametrize("batch", [1, 16, 32])
def test_fp16_fills_whole_waves(
    monkeypatch, head_dim, group, mse_bits, value_bits, batch
):
    gd = importlib.import_module(GROUPED)
    monkeypatch.setattr(gd, "_num_sms", lambda device: 132)
    regs = gd.grouped_decode_in_registers(
        False, mse_bits, value_bits, torch.float16, head_dim, group
    )
    splits = gd.grouped_decode_num_splits(
        batch, 4, 256 * 32 // batch, torch.device("cpu"), regs
    )
    programs, wave = batch * 4, 12 * 132
    empty = -(programs * splits) % wave
    assert empty < programs, (
        f"{splits} splits for {batch} requests x 4 KV heads on 132 SMs leave "
        f"{empty} of the last wave's {wave} program slots empty"
    )


@pytest.mark.parametrize("group", [4, 8, 16])
def test_head_256_keeps_its_launches(group):
    gd = importlib.import_module(GROUPED)
    for mse_bits, value_bits in ((4, 4), (3, 4), (3, 3)):
        assert not gd.grouped_decode_in_registers(
            False, mse_bits, value_bits, torch.float16, 256, group
        )
