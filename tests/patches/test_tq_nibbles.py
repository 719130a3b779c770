"""The grouped decode's registers stage 1 unpacks 4-bit codes four to an
instruction (tq-v0.33/0013).

0010's registers stage 1 split each code byte into its nibbles with Triton's
elementwise ``& 0xF`` and ``>> 4`` on uint8 tiles, which CUDA compiles to a
16-bit shift and conversions a byte; its values went through a byte
transpose in shared memory, and its centroid table took 17 instructions a
four codes. With the patch, on CUDA: the table reads a byte's low nibble
itself and the high one after one 32-bit shift of four bytes; the Lloyd-Max
centroids' symmetry (entry 15 - i = -entry i) halves the table (8 entries
and a sign); values go from four bytes to four centred fp16 in one PTX
block; the value tile is loaded transposed. The same fp16 values reach the
same MMAs, so the output is the 0012 output bit for bit; on an H200 the
token loop has 0.72-0.79x the instructions (ci/gpu/NOTES.md).

The regression test compiles the stage 1 the backend launches for sm_90 (no
GPU needed) and counts 16-bit shifts in its token loop's PTX. The PTX
blocks are run by an emulator of their instructions (tqptx.py) on every
code: Triton's interpreter runs no PTX, the other CPU tests take the gather.
They import the decode module under ``cpu_platform`` (conftest): on a GPU
host a source tree has no compiled extensions for CudaPlatform.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tqbatches as tb
from tqptx import compile_spec, compile_stage1, ptx_loop, run_ptx, stage1_launch

BYTEWISE = r"^the 4-bit codes are unpacked a byte at a time"
PRESETS = {"4bit_nc": "turboquant_4bit_nc", "k8v4": "turboquant_k8v4"}


@pytest.fixture(scope="module", params=list(PRESETS))
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a tiny GQA model (Hq 8, Hk 2, D 128)."""
    shape = tb.Shape(hq=8, hk=2, head=128, preset=PRESETS[request.param],
                     dtype=torch.bfloat16)  # fmt: skip
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"nibbles_{request.param}"
    )


@pytest.mark.cpu_only  # compiles for sm_90 without a GPU (as 0010's test)
@pytest.mark.bug_signature(AssertionError, BYTEWISE)
def test_codes_unpacked_four_to_an_instruction(
    env: tb.Backend, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = stage1_launch(env, monkeypatch)
    assert call["kernel"] == "_tq_grouped_decode_regs_stage1", call["kernel"]
    loop = ptx_loop(compile_stage1(compile_spec(call, "ptx", aligned=True), vllm_tree))
    shifts = [x.split()[0] for x in loop if x.split()[0] in ("shr.u16", "shl.b16")]
    assert not shifts, (
        f"the 4-bit codes are unpacked a byte at a time in the registers stage "
        f"1's token loop: {len(shifts)} 16-bit shifts ({', '.join(sorted(set(shifts)))}"
        f") of {len(loop)} PTX instructions"
    )


def fp16_bits(values: torch.Tensor) -> np.ndarray:
    return values.half().view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def halves(words: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """The four fp16 results of a PTX block: $0's low and high half, $1's."""
    return [w >> s & 0xFFFF for w in words for s in (0, 16)]


def table_entries(table: str, words: np.ndarray) -> list[np.ndarray]:
    return halves(run_ptx(table, words))


@pytest.mark.parametrize("head", [64, 128, 256])
def test_tables_read_each_nibble_of_raw_bytes(cpu_platform: Any, head: int) -> None:
    """The centroid tables (fp16 high and low parts) on raw code bytes: each
    byte's low nibble gives its entry whatever its high nibble holds, and
    after ``_HIGH_NIBBLES_PTX`` (one shift of four bytes) its high nibble
    does; the Lloyd-Max centroids take the symmetric table (no half select)."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    c = get_centroids(head, 4).float()
    parts = {"high": c.half(), "low": (c - c.half().float()).half()}
    rng = np.random.default_rng(head)
    quads = np.arange(1 << 16, dtype=np.uint32)
    low = sum(((quads >> (4 * i)) & 0xF) << (8 * i) for i in range(4))
    raw = low | (rng.integers(0, 1 << 32, quads.size, dtype=np.uint32) & 0xF0F0F0F0)
    swapped = ((raw & 0x0F0F0F0F) << 4) | ((raw >> 4) & 0x0F0F0F0F)
    (shifted,) = run_ptx(gd._HIGH_NIBBLES_SHIFT_PTX, swapped, first_in=1)
    for (part, entries), table in zip(parts.items(), gd._centroid_tables_ptx(head, 4)):
        assert "0xD8" not in table, f"the {part} table selects halves: not symmetric"
        want = [fp16_bits(entries)[(quads >> (4 * i)) & 0xF] for i in range(4)]
        for name, words in (("low nibbles", raw), ("high nibbles", shifted)):
            wrong = sum(int((g != w).sum())
                        for g, w in zip(table_entries(table, words), want))  # fmt: skip
            assert not wrong, (
                f"the {part} centroid table gives other entries for the {name} "
                f"of raw bytes: {wrong} of {4 << 16} codes (D {head})"
            )


@pytest.mark.parametrize("values", ["eight", "asymmetric"])
def test_tables_of_other_values(cpu_platform: Any, values: str) -> None:
    """The 3-bit centroids (8 entries, codes 0-7) and a table of 16 values
    without the symmetry (the half-select path) give each code's entry."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    if values == "eight":
        entries, n = get_centroids(128, 3).half(), 8
    else:
        entries, n = torch.linspace(-1.5, 0.7, 16).half(), 16
    table = gd._fp16_table_ptx(entries.float().tolist())
    quads = np.arange(n**4, dtype=np.uint32)
    codes = [quads // n**i % n for i in range(4)]
    words = sum(code << (8 * i) for i, code in enumerate(codes))
    got = table_entries(table, words.astype(np.uint32))
    wrong = sum(int((g != fp16_bits(entries)[c]).sum()) for g, c in zip(got, codes))
    assert not wrong, f"the {values} table gives other entries: {wrong} codes"


def test_value_nibbles_centred_on_every_byte(cpu_platform: Any) -> None:
    """``_LOW_NIBBLES_PTX`` and ``_HIGH_NIBBLES_PTX`` on four bytes: each
    byte's nibble - 7.5 in fp16 (``_centred_nibbles_fp16``), every byte
    value in every position."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint32)
    for i in range(4):  # every byte value at byte i
        words[256 * i : 256 * (i + 1)] &= ~np.uint32(0xFF << (8 * i))
        words[256 * i : 256 * (i + 1)] |= np.arange(256, dtype=np.uint32) << (8 * i)
    for name, ptx, shift in (("low", gd._LOW_NIBBLES_PTX, 0),
                             ("high", gd._HIGH_NIBBLES_PTX, 4)):  # fmt: skip
        got = halves(run_ptx(ptx, words))
        want = [fp16_bits(torch.from_numpy((words >> (8 * i + shift) & 0xF)
                                           .astype(np.float32) - 7.5))
                for i in range(4)]  # fmt: skip
        wrong = sum(int((g != w).sum()) for g, w in zip(got, want))
        assert not wrong, f"the {name} value nibbles: {wrong} of {4 << 16} wrong"
