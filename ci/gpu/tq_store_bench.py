"""The TurboQuant store on the GPU, the cost side of issue 54's layout:
v0.33.0's slot-layout store (``aos``, what CUDA runs today) beside its
turboquant_soa store with raw norms (``soa``, what a SoA decode with the
norm correction in the reader wants) and with folded norms (``soa_fold``,
what ROCm's FlyDSL path stores), on the same keys and values, timed with
CUDA events (median); each SoA page of 4-bit values checked byte for byte
against the slot pages rearranged (tq_plane_decode.to_soa_layout).

    python ci/gpu/tq_store_bench.py --tree T --out DIR [--small]

N tokens a call: 128 (a decode step of 128 requests), 8192 (a prefill
chunk); Hk 4, block 16, slots a random permutation of the cache's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import tqlib

PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc",
           "turboquant_k3v4_nc")  # fmt: skip
DIMS, TOKENS, HK, BLOCK = (128, 256), (128, 8192), 4, 16


def stores(preset: str, d: int, n: int) -> dict:
    """Each store's time and, for 4-bit values, whether the raw SoA page
    is the slot page rearranged."""
    import tq_plane_decode as pd
    import tqbatches as tb
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.attention.ops.triton_turboquant_store import (
        triton_turboquant_store as aos_store,
    )
    from vllm.v1.attention.ops.turboquant_soa.triton_turboquant_store import (
        triton_turboquant_store as soa_store,
    )

    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    dev, g = tqlib.DEVICE, torch.Generator(device=tqlib.DEVICE).manual_seed(n + d)
    blocks = -(-2 * n // BLOCK)
    k = tqlib.rand((n, HK, d), torch.bfloat16, g)
    v = tqlib.rand((n, HK, d), torch.bfloat16, g)
    slots = torch.randperm(blocks * BLOCK, device=dev, generator=g)[:n].int()
    c = get_centroids(d, max(cfg.key_mse_bits, 1)).float().to(dev)
    mid = ((c[1:] + c[:-1]) / 2).contiguous()
    pit = tb._hadamard(d).float().T.contiguous().to(dev)
    shape = (blocks, BLOCK, HK, cfg.slot_size_aligned)
    caches = {
        name: torch.zeros(shape, dtype=torch.uint8, device=dev)
        for name in ("aos", "soa", "soa_fold")
    }
    common = {
        "mse_bits": cfg.key_mse_bits,
        "key_packed_size": cfg.key_packed_size,
        "value_quant_bits": cfg.effective_value_quant_bits,
        "key_fp8": cfg.key_fp8,
    }

    def soa(name: str, fold: bool):
        kw = {"PiT": pit, "midpoints": mid, "centroids": c, **common}
        return lambda: soa_store(
            key=k, value=v, kv_cache=caches[name], slot_mapping=slots,
            norm_correction=fold and cfg.norm_correction, **kw,
        )  # fmt: skip

    calls = {
        "aos": lambda: aos_store(k, v, caches["aos"], slots, pit, mid, **common),
        "soa": soa("soa", False),
        "soa_fold": soa("soa_fold", True),
    }
    row = {"preset": preset, "D": d, "N": n}
    for name, fn in calls.items():
        row[name] = tqlib.time_calls(fn, 0.5 if tqlib.HAS_CUDA else 0)["median_ms"]
    if cfg.effective_value_quant_bits == 4 and (cfg.key_fp8 or cfg.key_mse_bits == 4):
        want = pd.to_soa_layout(caches["aos"], cfg)
        row["soa_is_aos_rearranged"] = bool(
            torch.equal(want, caches["soa"].view(blocks, -1))
        )
    return row


def table(rows: list[dict], device: str) -> str:
    cols = "aos | soa | soa_fold | soa / aos | soa = aos rearranged"
    lines = [
        f"### TurboQuant store, ms ({device}, Hk {HK}, block {BLOCK})",
        "",
        f"| preset | D | N | {cols} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = r.get("soa_is_aos_rearranged", "-")
        lines.append(
            f"| {r['preset'].removeprefix('turboquant_')} | {r['D']} | {r['N']} | "
            f"{r['aos']:.4f} | {r['soa']:.4f} | {r['soa_fold']:.4f} | "
            f"{r['soa'] / r['aos']:.2f} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="CPU shapes")
    args = ap.parse_args()
    tqlib.use_tree(args.tree)
    dims, tokens = ((64,), (40,)) if args.small else (DIMS, TOKENS)
    rows = [stores(p, d, n) for p in PRESETS for d in dims for n in tokens]
    device = tqlib.device_info().get("device", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tq_store_bench.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = table(rows, device)
    (out / "tq_store_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
