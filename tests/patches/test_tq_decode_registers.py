"""The grouped TurboQuant decode dequantizes 4-bit codes in the MMA's
registers (tq-v0.33/0010).

The stage 1 that the grouped launcher runs for a 4-bit preset is compiled
for sm_90 by Triton's own compiler (no GPU needed) and its TTGIR read: in the
token loop, no floating-point tile of the cache's head-dimension width may
go through shared memory. Before the patch the dequantized fp16 key and
value tiles are the MMA's B operand, stored to shared memory every tile;
with it the tokens are the MMA's M rows, the code bytes go through shared
memory and are dequantized in each thread's A-operand fragment.

The 4-bit keys' centroids come from a table in inline PTX on CUDA, which
Triton's interpreter cannot run: an emulator of its few instructions runs
it here on every four codes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tqbatches as tb
from tqptx import compile_spec, compile_stage1, run_ptx, stage1_launch

SHARED_F16 = r"^the 4-bit decode stores dequantized cache tiles to shared memory"
# 4-bit MSE keys: FP8 keys and 4-bit values already reached the MMA as
# converted bytes before (Triton moved their conversions past the load).
PRESETS = {"4bit_nc": "turboquant_4bit_nc"}


@pytest.fixture(scope="module", params=list(PRESETS))
def env(
    request: pytest.FixtureRequest,
    vllm_tree: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tb.Backend]:
    """The tree's backend for a tiny GQA model (Hq 8, Hk 2, D 128)."""
    shape = tb.Shape(hq=8, hk=2, head=128, preset=PRESETS[request.param])
    yield from tb.backend_fixture(
        vllm_tree, tmp_path_factory, shape, f"tiny_{request.param}"
    )


def loop_body(ttgir: str) -> str:
    """The TTGIR between the token loop's scf.for and its scf.yield."""
    start = ttgir.index("scf.for")
    return ttgir[start : ttgir.rindex("scf.yield")]


@pytest.mark.cpu_only  # compiles for sm_90 without a GPU; where one is, the
# child's vLLM picks CudaPlatform, which needs the compiled extensions
@pytest.mark.bug_signature(AssertionError, SHARED_F16)
def test_4bit_codes_dequantized_in_mma_registers(
    env: tb.Backend, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = stage1_launch(env, monkeypatch)
    spec = compile_spec(call)
    d = spec["constexprs"]["HEAD_DIM"]
    tiles = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+)x(f16|bf16|f32)",
                       loop_body(compile_stage1(spec, vllm_tree)))  # fmt: skip
    wide = [
        f"{s}x{t}" for s, t in tiles if {d, d // 2} & {int(n) for n in s.split("x")}
    ]
    assert not wide, (
        f"the 4-bit decode stores dequantized cache tiles to shared memory every "
        f"step ({', '.join(wide)} in {call['kernel']}), the MMA's B operand, "
        f"instead of dequantizing the code bytes in its registers"
    )


# --------------------------------------------------------------------------
# The centroid table in PTX, run here by an emulator of its instructions
# --------------------------------------------------------------------------


@pytest.mark.parametrize("head", [64, 128, 256])
def test_ptx_centroid_table_gives_each_codes_entry(vllm_tree: Path, head: int) -> None:
    """The PTX the registers stage 1 takes on CUDA for 4-bit keys (a table
    of the centroids' fp16 high parts, and one of their low parts), run by
    an emulator of its instructions on every four codes (16**4 words): each
    code's fp16 entry, in the order the MMA fragment packs them (codes 0
    and 1 in $0, 2 and 3 in $1, the first in the low half). Triton's
    interpreter runs no PTX, so the other CPU tests take the gather."""
    import vllm.v1.attention.ops.triton_turboquant_grouped_decode as gd
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    c = get_centroids(head, 4).float()
    entries = {"high": c.half(), "low": (c - c.half().float()).half()}
    tables = dict(zip(entries, gd._centroid_tables_ptx(head, 4)))
    quads = np.arange(1 << 16, dtype=np.uint32)
    codes = sum(((quads >> (4 * i)) & 0xF) << (8 * i) for i in range(4))
    for part, table in tables.items():
        bits = entries[part].view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
        want = [bits[(quads >> (4 * i)) & 0xF] for i in range(4)]
        got = run_ptx(table, codes.astype(np.uint32))
        pairs = [(got[0] & 0xFFFF, got[0] >> 16), (got[1] & 0xFFFF, got[1] >> 16)]
        wrong = sum(int((g != w).sum()) for g, w in zip(sum(pairs, ()), want))
        assert not wrong, (
            f"the PTX centroid table gives other entries than the centroids' "
            f"{part} parts: {wrong} of {4 << 16} codes wrong (D {head})"
        )
