"""The grouped decode's registers stage 1 loads 3-bit codes as words and
spreads them to nibbles in registers (tq-v0.33/0014).

0012 took 3-bit codes into the registers stage 1 through 0009's ``_codes``:
three byte loads a group of eight codes, a 24-bit word, and two int32 tiles
reshaped from [rows, D / 8, 4], which CUDA moves through shared memory a
code at a time before the MMA's operand layout. With the patch twelve bytes
(four groups) come as three 32-bit words (two 16-bit loads each on the
2-byte-aligned slots), each group is spread to eight nibbles in registers,
and the tile is the 4-bit codes' tile from there on: byte j holds dims 2j
and 2j + 1, the PTX centroid table and value block read it four codes at a
time. On an H200 the token loop has 0.56-0.73x the instructions
(ci/gpu/NOTES.md).

The regression test compiles the stage 1 the backend launches for
turboquant_3bit_nc for sm_90 (no GPU needed) and counts the scalar 8- and
16-bit shared-memory stores in its token loop's PTX (with Triton 3.9, the
project's; Triton 3.6 still moves the byte tile through 16-bit shared
stores, and the patch's vLLM test checks the byte loads, which go with
both). ``_code_bytes`` runs
in Triton's interpreter against a reference unpacking at every alignment it
takes, and the 3-bit value blocks in the PTX emulator (tqptx.py) on every
byte. The other CPU tests run every preset through the backend.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tqbatches as tb
import triton
import triton.language as tl
from tqptx import compile_spec, compile_stage1, ptx_loop, run_ptx, stage1_launch

CODEWISE = r"^the 3-bit codes go through shared memory a code at a time"
gd: Any = None  # the tree's decode module, imported by the tests


@triton.jit
def unpack_3bit(Cache, Out, first, stride, ROWS: tl.constexpr, HALF: tl.constexpr,
                ALIGN: tl.constexpr):  # fmt: skip
    """``_code_bytes`` of ROWS 3-bit rows at ``first + row x stride``."""
    rows = tl.arange(0, ROWS)
    b = gd._code_bytes(Cache, first + rows * stride, rows < ROWS, 3, HALF, ALIGN)
    tl.store(Out + rows[:, None] * HALF + tl.arange(0, HALF)[None, :], b)


@pytest.fixture(scope="module")
def env(
    vllm_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tb.Backend]:
    """The tree's backend for a tiny GQA model (Hq 8, Hk 2, D 128), 3-bit."""
    shape = tb.Shape(hq=8, hk=2, head=128, preset="turboquant_3bit_nc",
                     dtype=torch.bfloat16)  # fmt: skip
    yield from tb.backend_fixture(vllm_tree, tmp_path_factory, shape, "words_3bit")


@pytest.mark.cpu_only  # compiles for sm_90 without a GPU (as 0013's test)
@pytest.mark.bug_signature(AssertionError, CODEWISE)
def test_3bit_codes_unpacked_from_words(
    env: tb.Backend, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = stage1_launch(env, monkeypatch)
    assert call["kernel"] == "_tq_grouped_decode_regs_stage1", call["kernel"]
    ptx = compile_stage1(compile_spec(call, "ptx", aligned=True), vllm_tree)
    loop = ptx_loop(ptx)
    narrow = [x.split()[0] for x in loop
              if re.fullmatch(r"st\.shared\.[bsu](8|16)", x.split()[0])]  # fmt: skip
    assert not narrow, (
        f"the 3-bit codes go through shared memory a code at a time in the "
        f"registers stage 1's token loop: {len(narrow)} scalar stores "
        f"({', '.join(sorted(set(narrow)))}) of {len(loop)} PTX instructions"
    )
    mids = set(re.findall(r"0x600[0-9A-F]600[0-9A-F]", ptx))
    assert mids == {"0x60076007"}, f"3-bit values centred by {sorted(mids)}"


def packed_3bit(codes: np.ndarray) -> np.ndarray:
    """Rows of 3-bit codes packed as the cache stores them: eight in three
    bytes, code i of a group at bits 3i of its little-endian 24 bits."""
    groups = codes.reshape(codes.shape[0], -1, 8).astype(np.uint32)
    words = sum(groups[..., i] << (3 * i) for i in range(8))
    return (
        np.stack([(words >> s) & 0xFF for s in (0, 8, 16)], -1)
        .reshape(codes.shape[0], -1)
        .astype(np.uint8)
    )


@pytest.mark.parametrize("align", [1, 2, 4])
@pytest.mark.parametrize("head", [32, 128])
def test_code_bytes_unpack_3bit_rows(cpu_platform: Any, align: int, head: int) -> None:
    """``_code_bytes`` of 3-bit rows at ``align``-byte addresses: byte j
    holds the codes of dims 2j and 2j + 1, each in 3 bits of its nibble."""
    global gd
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    rows, nbytes = 16, head * 3 // 8
    stride = nbytes + align  # every row start a multiple of align, not 2 align
    codes = np.random.default_rng(head + align).integers(0, 8, (rows, head))
    cache = np.zeros(align + rows * stride + 16, np.uint8)
    for r, row in enumerate(packed_3bit(codes)):
        cache[align + r * stride :][:nbytes] = row
    out = torch.zeros(rows, head // 2, dtype=torch.uint8, device=device)
    unpack_3bit[(1,)](torch.from_numpy(cache).to(device), out, align, stride, rows,
                 head // 2, align)  # fmt: skip
    got = out.cpu().numpy().astype(np.int64)
    want = codes[:, 0::2] | (codes[:, 1::2] << 4)
    wrong = int((got != want).sum())
    assert not wrong, f"{wrong} of {got.size} code bytes wrong (align {align})"


def test_3bit_value_nibbles_centred(cpu_platform: Any) -> None:
    """``_LOW_NIBBLES_3BIT_PTX`` and ``_HIGH_NIBBLES_3BIT_PTX`` on four bytes
    of two 3-bit codes each (``_code_bytes``: bits 3 and 7 clear): each
    code - 3.5 in fp16, every such byte in every position."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd

    values = np.array([lo | hi << 4 for lo in range(8) for hi in range(8)], np.uint32)
    picks = np.random.default_rng(3).integers(0, values.size, (4, 1 << 14))
    for i in range(4):  # every such byte at byte i
        picks[i, 64 * i : 64 * (i + 1)] = np.arange(64)
    byte = [values[p] for p in picks]
    words = sum(b << (8 * i) for i, b in enumerate(byte)).astype(np.uint32)
    for name, ptx, shift in (("low", gd._LOW_NIBBLES_3BIT_PTX, 0),
                             ("high", gd._HIGH_NIBBLES_3BIT_PTX, 4)):  # fmt: skip
        w0, w1 = run_ptx(ptx, words)
        got = [w >> s & 0xFFFF for w in (w0, w1) for s in (0, 16)]
        want = [torch.from_numpy(((b >> shift) & 7).astype(np.float32) - 3.5)
                .half().view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
                for b in byte]  # fmt: skip
        wrong = sum(int((g != w).sum()) for g, w in zip(got, want))
        assert not wrong, f"the {name} 3-bit value nibbles: {wrong} wrong"
