"""TurboQuant continuation prefill: time, memory and reserved workspace of one
vLLM tree (issue 3 / tq/0001). One variant per process:

  a  v0.20.2 unpatched: per-layer dequant buffers sized by the context
  b  an unpatched later release: full dequant into the shared workspace,
     as the release reserves it (v0.24.0+), or on v0.21.0, which reserves
     nothing, pre-grown to what v0.24.0 reserves (2 x round_up(max_model_len
     - 1, block) x Hk x D x 2 B); locked
  c  the patched tree: tiled dequant in a workspace reserved at impl
     construction, locked

Shapes: Qwen3.5-9B attention (Hq=16, Hk=4, D=256, bf16), block 16, presets
turboquant_4bit_nc and turboquant_k8v4, cached_len 4K/32K/128K, q_len
512/4096, one continuation request per call through ``forward()`` (its chunk
already stored, as the runner does). Attention modes:

  sdpa  the tree as it runs on the device (vLLM's compiled flash-attn is
        absent there: _HAS_FLASH_ATTN False, SDPA / PyTorch fallbacks)
  fa    the tree's flash-attn path, PyTorch's bundled FA2 standing in for
        vllm_flash_attn (tqlib.flash_attn_varlen_shim)

Writes JSON (--out) and row samples of every output (--samples, a .pt file)
for the cross-variant check done by summarize.py. --small: CPU shapes.

    python ci/gpu/tq_continuation_bench.py --tree T --variant c --out c.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import tqlib  # noqa: E402

HQ, HK, D = 16, 4, 256
BLOCK = 16
DTYPE = torch.bfloat16
PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4")
CACHED = (4096, 32768, 131072)
QLENS = (512, 4096)
MNBT = 8192  # max_num_batched_tokens: the patched tile is round_up(8192, 128)
MML = (131072, 1 << 20)  # max_model_len for the reserved-bytes figures
PROFILE = ((32768, 4096), (131072, 4096), (131072, 512))
CATEGORIES = {
    "dequant": ("tq_full_dequant",),
    "attention": ("flash", "fmha", "attention", "softmax"),
    "merge": ("merge_attn", "logaddexp"),
    "gemm": ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas"),
    "copy": ("copy", "cat", "memcpy", "memset", "fill", "zero"),
}


def reservation(env, variant: str) -> dict:
    """Workspace bytes reserved before lock at max_model_len 128K and 1M."""
    out = {}
    for mml in MML:
        env.workspace.reset_workspace_manager()
        if variant == "a":
            # No workspace: per-layer fp16 K and V buffers grow to the
            # longest cached context (the formula; measured retention below).
            alloc = -(-(mml - 1) // BLOCK) * BLOCK
            out[str(mml)] = {
                "per_layer_bytes": 2 * alloc * HK * D * 2,
                "workspace_bytes": 0,
            }
            continue
        reserve(env, variant, mml)
        out[str(mml)] = {"workspace_bytes": tqlib.workspace_bytes()}
        env.workspace.reset_workspace_manager()
        if tqlib.HAS_CUDA:
            torch.cuda.empty_cache()
    return out


def reserve(env, variant: str, mml: int) -> tuple[dict, dict]:
    """As the model runner up to the lock: workspace manager (b, c), impls
    and builders by preset (the tree's own reservation: the patched tiles,
    or a later release's max_model_len-sized buffer); b on a tree that
    reserves nothing (v0.21.0) gets v0.24.0's reservation."""
    ws = env.workspace
    if variant in "bc":
        ws.init_workspace_manager(tqlib.DEVICE)
    cfgs = {p: config(env, p, mml) for p in PRESETS}
    impls = {p: tqlib.make_impl(env, cfgs[p], p, HQ, HK, D) for p in PRESETS}
    builders = {p: tqlib.make_builder(env, cfgs[p], HQ, HK, D) for p in PRESETS}
    if variant == "b" and tqlib.workspace_bytes() == 0:
        alloc = -(-(mml - 1) // BLOCK) * BLOCK
        shape = (1, HK, alloc, D)
        ws.current_workspace_manager().get_simultaneous(
            (shape, torch.float16), (shape, torch.float16)
        )
    return impls, builders


def config(env, preset: str, max_model_len: int):
    return tqlib.make_config(
        env, hq=HQ, hk=HK, d=D, preset=preset, block_size=BLOCK,
        max_num_batched_tokens=MNBT, max_model_len=max_model_len,
    )  # fmt: skip


def floor_ms(preset: str, slot_bytes: int, cached: int, q: int, ceil: dict) -> dict:
    """Compressed cached K/V read once + chunk q/k/v/out, vs attention FLOPs."""
    bytes_ = cached * HK * slot_bytes + q * (2 * HQ + 2 * HK) * D * 2
    flops = 4 * q * cached * HQ * D + 2 * q * q * HQ * D
    t_mem = bytes_ / ceil["copy_bytes_per_s"] * 1e3
    t_mm = flops / ceil["bf16_flops_per_s"] * 1e3
    return {
        "bytes": bytes_,
        "flops": flops,
        "mem_ms": t_mem,
        "mm_ms": t_mm,
        "floor_ms": max(t_mem, t_mm),
    }


def parse_args() -> argparse.Namespace:
    global HQ, HK, D, CACHED, QLENS, MNBT, MML, PROFILE
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--variant", choices="abc", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", default="")
    ap.add_argument("--modes", default="sdpa,fa")
    ap.add_argument(
        "--budget", type=float, default=0.8, help="timing seconds per shape"
    )
    ap.add_argument("--small", action="store_true", help="CPU sanity shapes")
    args = ap.parse_args()
    if args.small:
        HQ, HK, D = 4, 1, 64
        CACHED, QLENS, MNBT = (600,), (130,), 256
        MML, PROFILE = (2048, 8192), ((600, 130),)
    return args


def header(args, env, modes: list[str]) -> dict:
    """The result's head: what ran where, the device's ceilings, the
    stand-in's check, the reservations."""
    res: dict = {
        "variant": args.variant,
        "tree": str(env.tree),
        "device": tqlib.device_info(),
        "tree_has_flash_attn": env.has_flash_attn,
        "shape": {
            "Hq": HQ,
            "Hk": HK,
            "D": D,
            "block_size": BLOCK,
            "dtype": str(DTYPE),
            "max_num_batched_tokens": MNBT,
        },
        "modes": modes,
        "runs": [],
        "errors": [],
    }
    res["ceilings"] = tqlib.ceilings()
    if args.variant == "c" and "fa" in modes:
        res["shim_check"] = tqlib.check_shim()
    res["reserved"] = reservation(env, args.variant)
    print(
        f"[{args.variant}] ceilings {res['ceilings']} reserved {res['reserved']}",
        flush=True,
    )
    return res


def build(env, variant: str, res: dict) -> tuple[dict, dict]:
    """The timed impls and builders by preset, reserved (``reserve``) at
    max_model_len 128K, then the workspace locked."""
    env.workspace.reset_workspace_manager()
    impls, builders = reserve(env, variant, MML[0])
    if variant in "bc":
        env.workspace.lock_workspace()
        res["bench_workspace_bytes"] = tqlib.workspace_bytes()
    if variant == "c":
        res["tile_tokens"] = impls[PRESETS[0]]._tile_tokens
    return impls, builders


class Preset:
    """One preset's impl, layer, builder and a cache holding the longest
    request, with its raw K/V and queries."""

    def __init__(self, env, preset: str, impl, builder) -> None:
        self.preset, self.impl, self.builder = preset, impl, builder
        self.layer = tqlib.make_layer(env, impl, D)
        seq_max = max(CACHED) + max(QLENS)
        self.paged = tqlib.Paged(
            impl, self.layer, preset, HK, D, BLOCK, [seq_max], seed=1
        )
        g = torch.Generator(device=tqlib.DEVICE).manual_seed(2)
        self.k_all = tqlib.rand((seq_max, HK, D), DTYPE, g)
        self.v_all = tqlib.rand((seq_max, HK, D), DTYPE, g)
        self.paged.store(0, 0, self.k_all, self.v_all)
        self.q_all = tqlib.rand((max(QLENS), HQ * D), DTYPE, g)
        tqlib.sync()

    def call(self, cached: int, q: int) -> tuple:
        """forward() of one continuation chunk of q after ``cached``, and
        its output tensor."""
        meta = self.builder.build(0, tqlib.make_cam(self.paged, [0], [cached], [q]))
        key_t = self.k_all[cached : cached + q].reshape(q, -1)
        val_t = self.v_all[cached : cached + q].reshape(q, -1)
        output = torch.empty(q, HQ * D, dtype=DTYPE, device=tqlib.DEVICE)

        def call():
            self.impl.forward(
                self.layer, self.q_all[:q], key_t, val_t, self.paged.kv_cache, meta,
                output=output,
            )  # fmt: skip

        return call, output


def measure(args, ctx: Preset, call, output, q: int, row: dict) -> torch.Tensor:
    """First call (time, memory), then timed calls; returns output samples."""
    tqlib.sync()
    if tqlib.HAS_CUDA:
        torch.cuda.empty_cache()
        m0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    call()
    tqlib.sync()
    row["first_call_s"] = time.perf_counter() - t0
    if tqlib.HAS_CUDA:
        row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - m0
        row["retained_bytes"] = torch.cuda.memory_allocated() - m0
        row["peak_total_bytes"] = torch.cuda.max_memory_allocated()
    row["layer_buffer_bytes"] = tqlib.layer_tensor_bytes(ctx.layer)
    idx = torch.linspace(0, q - 1, 64).long()
    sample = output.view(q, HQ, D)[idx].float().cpu()
    row["finite"] = bool(torch.isfinite(output).all())
    budget = args.budget if row["first_call_s"] < 5 else 0
    row["time"] = tqlib.time_calls(
        call, budget, min_reps=3 if budget and not args.small else 1
    )
    row["vs_floor"] = row["time"]["median_ms"] / row["floor"]["floor_ms"]
    profiled = (row["cached"], q) in PROFILE and args.variant in "bc"
    if ctx.preset == PRESETS[0] and profiled:
        row["split"] = tqlib.kernel_split(call, CATEGORIES)
    return sample


def run_shape(args, ctx: Preset, mode: str, cached: int, q: int, res, samples):
    key = f"{ctx.preset}/{mode}/{cached}/{q}"
    row = {"preset": ctx.preset, "mode": mode, "cached": cached, "q": q}
    row["floor"] = floor_ms(
        ctx.preset, ctx.paged.slot_bytes, cached, q, res["ceilings"]
    )
    call, output = ctx.call(cached, q)
    try:
        samples[key] = measure(args, ctx, call, output, q, row)
    except Exception as e:  # OOM or a tree's own error: record, go on
        oom = isinstance(e, torch.OutOfMemoryError)
        row["error"] = ("OOM: " if oom else "") + f"{type(e).__name__}: {e}"[:400]
        res["errors"].append({"key": key, "trace": traceback.format_exc()[-2000:]})
        if tqlib.HAS_CUDA:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    res["runs"].append(row)
    t = row.get("time", {}).get("median_ms")
    peak = row.get("peak_extra_bytes", 0) / 2**20
    print(
        f"[{args.variant}] {key}: "
        + (f"{t:.3f} ms" if t is not None else row.get("error", "?"))
        + (f" peak+{peak:.0f} MiB" if tqlib.HAS_CUDA else ""),
        flush=True,
    )


def main() -> int:
    args = parse_args()
    t_start = time.time()
    env = tqlib.use_tree(args.tree)
    if args.small and hasattr(env.tqa, "_CONTINUATION_TILE_MIN"):
        env.tqa._CONTINUATION_TILE_MIN = env.tqa._CONTINUATION_TILE_MAX = 256
    modes = args.modes.split(",")
    res = header(args, env, modes)
    impls, builders = build(env, args.variant, res)
    samples: dict = {}
    for preset in PRESETS:
        ctx = Preset(env, preset, impls[preset], builders[preset])
        for mode in modes:
            tqlib.set_attention_mode(env, mode)
            for cached in CACHED:
                for q in QLENS:
                    run_shape(args, ctx, mode, cached, q, res, samples)
        del ctx
        if tqlib.HAS_CUDA:
            torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t_start
    Path(args.out).write_text(json.dumps(res, indent=1))
    if args.samples:
        torch.save(samples, args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
