"""Shared helpers of the GPU scripts in ci/gpu/: import vLLM from a source
tree, build a TurboQuant config, impl, layer, metadata builder, cache and
metadata with the targeted tests' harness (tests/patches/tqharness.py, so a
vLLM API change is fixed there once), time calls with CUDA events, and
stand in for flash-attn.

Every script runs ONE tree per process (``--tree DIR``, the directory holding
``vllm/``): a failed CUDA-graph capture can poison the CUDA context, and two
trees cannot share ``sys.modules``.

On a CPU-only box (sanity checks before a GPU call) the same code runs with
``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` (set here when torch
sees no GPU) on small shapes.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "patches"))
import tqharness as h  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def use_tree(tree: str | Path) -> SimpleNamespace:
    """Make ``tree`` this process's vLLM in the tests' environment
    (``tqharness.use_tree_env``), install the platform, import the
    TurboQuant backend; returns the modules the scripts use.

    A plain source tree runs on CpuPlatform with its tensors and Triton
    kernels on the GPU (vLLM's compiled flash-attn is absent:
    ``_HAS_FLASH_ATTN`` is False, merge_attn_states takes vLLM's Triton
    kernel); a tree with its compiled extensions gets CudaPlatform."""
    tree = Path(tree).resolve()
    if not (tree / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"{tree}: no vllm/__init__.py")
    h.use_tree_env(tree)
    import vllm

    got = Path(vllm.__file__).resolve()
    assert tree in got.parents, f"vllm imported from {got}, not from {tree}"
    h.install_platform(tree)
    h.inspect_models_in_process()
    from vllm.v1.worker import workspace

    tqa = h.tq_module()
    return SimpleNamespace(
        tree=tree,
        tqa=tqa,
        workspace=workspace,
        has_flash_attn=bool(tqa._HAS_FLASH_ATTN),
        models=Path(tempfile.mkdtemp(prefix="tq-model-")),
    )


def converted_cache(kv_cache, args: dict, convert: Callable, held: dict):
    """``convert(kv_cache, cfg)`` once a cache version, one at a time in
    ``held`` (the suite's memory): a suite variant's copy of the cache in
    its layout. ``cfg`` holds the preset's fields the launchers' ``args``
    carry."""
    key = (kv_cache.data_ptr(), kv_cache._version, kv_cache.shape)
    if key not in held:
        held.clear()
        cfg = SimpleNamespace(
            head_dim=args["query"].shape[-1],
            key_fp8=args.get("key_fp8", False),
            key_mse_bits=args["mse_bits"],
            key_packed_size=args["key_packed_size"],
            effective_value_quant_bits=args["value_quant_bits"],
        )
        held[key] = convert(kv_cache, cfg)
    return held[key]


def load_module(name: str, path: str | Path) -> ModuleType:
    """A kernel module from its file, beside the tree's (its imports
    resolve in the tree), as sys.modules[name]."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_config(
    env: SimpleNamespace,
    *,
    hq: int,
    hk: int,
    d: int,
    preset: str,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    max_num_seqs: int = 64,
) -> Any:
    """A real VllmConfig through EngineArgs for a tiny local model of these
    attention shapes (the tree's default attention settings)."""
    model = h.write_tiny_model(
        env.models / f"h{hq}_k{hk}_d{d}",
        num_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=str(dtype).removeprefix("torch."),
    )
    return h.make_vllm_config(
        model,
        preset=preset,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        kv_splits=None,
    )


def make_impl(env, config, preset: str, hq: int, hk: int, d: int) -> Any:
    return h.tq_impl(config, hq, d, hk, preset, env.tqa)


def make_layer(env, impl, d: int) -> torch.nn.Module:
    return h.centroids_layer(impl, d, DEVICE)


def make_builder(env, config, hq: int, hk: int, d: int) -> Any:
    """The metadata builder for the KV cache spec of a real TurboQuant
    Attention layer (registered in ``config``: one builder per config)."""
    attn = h.build_tq_attention(config, hq, d, hk)
    spec = h.runner_kv_cache_spec(attn, config)
    return h.tq_builder(config, spec, [attn.layer_name], DEVICE, env.tqa)


workspace_bytes = h.workspace_bytes


def layer_tensor_bytes(layer) -> int:
    """Bytes of the per-layer dequant buffers v0.20.2 hangs on the layer."""
    n = 0
    for name in ("_tq_k_dequant_buf", "_tq_v_dequant_buf"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            n += t.numel() * t.element_size()
    return n


# --------------------------------------------------------------------------
# Requests, the cache and the metadata
# --------------------------------------------------------------------------


class Paged:
    """A TurboQuant cache (laid out as the tree's runner lays it out)
    holding whole requests at random block ids."""

    def __init__(self, impl, layer, preset, hk, d, block_size, seqs, seed):
        self.impl, self.layer = impl, layer
        nblk = [math.ceil(s / block_size) for s in seqs]
        total = sum(nblk) + 1
        g = torch.Generator().manual_seed(seed)
        # Random bytes: a slot nobody wrote reads as garbage.
        cache = h.new_tq_kv_cache(
            total, block_size, hk, d, preset, generator=g, device=DEVICE
        )
        self.kv_cache = cache.runner
        self.slot_bytes = cache.slots.shape[-1]
        perm = torch.randperm(total, generator=g).to(DEVICE)
        self.block_table = torch.zeros(
            len(seqs), max(nblk), dtype=torch.int32, device=DEVICE
        )
        self.slots = []
        off = 0
        for i, (s, nb) in enumerate(zip(seqs, nblk, strict=True)):
            ids = perm[off : off + nb].to(torch.int32)
            off += nb
            self.block_table[i, :nb] = ids
            pos = torch.arange(s, device=DEVICE)
            self.slots.append(
                ids[pos // block_size].long() * block_size + pos % block_size
            )
        self.seqs = list(seqs)

    def store(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize + store raw K/V of request i at positions start.. (chunks
        of 64K tokens to bound the store's temporaries)."""
        n = k.shape[0]
        step = 1 << 16
        for a in range(0, n, step):
            b = min(n, a + step)
            self.impl.do_kv_cache_update(
                self.layer,
                k[a:b].reshape(b - a, -1),
                v[a:b].reshape(b - a, -1),
                self.kv_cache,
                self.slots[i][start + a : start + b],
            )


def rand(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=torch.float32, generator=gen).to(
        dtype
    )


def make_cam(paged: Paged, rows: list[int], cached: list[int], qlens: list[int]):
    """CommonAttentionMetadata for requests ``rows`` of ``paged`` scheduling
    ``qlens[j]`` tokens after ``cached[j]`` (host and device copies, as the
    runner makes them)."""
    seq = [c + q for c, q in zip(cached, qlens, strict=True)]
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    slot_mapping = torch.cat(
        [paged.slots[r][c : c + q] for r, c, q in zip(rows, cached, qlens, strict=True)]
    )
    return h.common_attn_metadata(
        query_start_loc=qsl.to(DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(DEVICE),
        num_reqs=len(rows),
        num_actual_tokens=int(sum(qlens)),
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        block_table_tensor=paged.block_table[rows].contiguous(),
        slot_mapping=slot_mapping.to(torch.int64),
        _seq_lens_cpu=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens,
    )


# --------------------------------------------------------------------------
# flash-attn stand-in: PyTorch's bundled FlashAttention-2 (varlen, GQA, LSE)
# --------------------------------------------------------------------------


class TorchFlashAttn(h.ReferenceFlashAttn):
    """vllm_flash_attn's ``flash_attn_varlen_func`` on PyTorch's own FA2
    (``aten._flash_attention_forward``: varlen, GQA, bottom-right causal,
    LSE (Hq, total_q)); CPU: the tests' float64 reference."""

    def attend(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, causal):
        if not q.is_cuda:
            return super().attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        o, lse = res[0], res[1]
        if lse.dim() == 3:  # padded (batch, heads, max_q): one sequence here
            lse = lse[0, :, : q.shape[0]]
        return o, lse


flash_attn_varlen_shim = TorchFlashAttn()


def set_attention_mode(env, mode: str) -> None:
    """``sdpa``: the tree as it runs here (vLLM's compiled flash-attn absent,
    ``_HAS_FLASH_ATTN`` False: SDPA / PyTorch fallbacks). ``fa``: its
    flash-attn path, with PyTorch's FA2 standing in for vllm_flash_attn and
    vLLM's Triton merge_attn_states for the CUDA one (a compiled op)."""
    tqa = env.tqa
    if not hasattr(env, "_orig"):
        env._orig = {
            n: getattr(tqa, n, None)
            for n in ("_HAS_FLASH_ATTN", "flash_attn_varlen_func", "merge_attn_states")
        }
    if mode == "sdpa":
        for n, val in env._orig.items():
            if val is not None or hasattr(tqa, n):
                setattr(tqa, n, val)
        tqa._HAS_FLASH_ATTN = False
    elif mode == "fa":
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

        tqa._HAS_FLASH_ATTN = True
        tqa.flash_attn_varlen_func = flash_attn_varlen_shim
        if hasattr(tqa, "merge_attn_states"):
            tqa.merge_attn_states = merge_attn_states
    else:
        raise ValueError(mode)


def check_shim() -> dict:
    """The stand-in against the float64 reference: GQA, bottom-right causal,
    LSE."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    res = {}
    for lq, lk, causal in ((256, 1024, True), (200, 700, False), (128, 128, True)):
        q = rand((lq, 16, 256), torch.bfloat16, g)
        k = rand((lk, 4, 256), torch.bfloat16, g)
        v = rand((lk, 4, 256), torch.bfloat16, g)
        cq = torch.tensor([0, lq], dtype=torch.int32, device=DEVICE)
        ck = torch.tensor([0, lk], dtype=torch.int32, device=DEVICE)
        o, lse = flash_attn_varlen_shim(
            q, k, v, cq, ck, lq, lk, 256**-0.5, causal, return_softmax_lse=True
        )
        ro, rl = h.ReferenceFlashAttn().attend(
            q.cpu(), k.cpu(), v.cpu(), cq.cpu(), ck.cpu(), lq, lk, 256**-0.5, causal
        )
        res[f"q{lq}_k{lk}_causal{int(causal)}"] = {
            "out_rel_err": rel_err(o, ro),
            "lse_max_abs_err": float((lse.float().cpu() - rl).abs().max()),
        }
    return res


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().float().cpu()
    b = b.detach().float().cpu()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def time_calls(
    fn: Callable[[], Any], budget_s: float, min_reps: int = 3, max_reps: int = 30
) -> dict:
    """Median of many calls after one warm-up, each timed with CUDA events
    (host clock on CPU). Reps fit ``budget_s`` after the warm-up's estimate."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    est = time.perf_counter() - t0
    reps = int(max(min_reps, min(max_reps, budget_s / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        if HAS_CUDA:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "min_ms": times[0],
        "p20_ms": times[len(times) // 5],
        "p80_ms": times[(len(times) * 4) // 5 - (1 if len(times) >= 5 else 0)],
        "reps": reps,
    }


def ceilings(small: bool = False) -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written) and
    bf16 matmul rate, each the median of 10 after 3 warm-ups."""
    if not HAS_CUDA:
        return {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11, "note": "cpu dummy"}
    n = 1 << 30  # 1 GiB source
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    t = time_calls(lambda d=dst, s=src: d.copy_(s), 0.3, 10, 10)
    bw = 2 * n / (t["median_ms"] * 1e-3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t2 = time_calls(lambda a=a, b=b: a @ b, 0.3, 10, 10)
    rate = 2 * m**3 / (t2["median_ms"] * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return {
        "copy_bytes_per_s": bw,
        "bf16_flops_per_s": rate,
        "copy_ms": t["median_ms"],
        "matmul_ms": t2["median_ms"],
    }


def device_info() -> dict:
    if not HAS_CUDA:
        return {"device": "cpu"}
    p = torch.cuda.get_device_properties(0)
    return {
        "device": p.name,
        "sms": p.multi_processor_count,
        "mem_gib": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def kernel_split(fn: Callable[[], Any], categories: dict[str, tuple[str, ...]]) -> dict:
    """Device time of one call by kernel category (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if HAS_CUDA else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    split: dict[str, float] = {}
    top: dict[str, float] = {}
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if HAS_CUDA and (dt is None or "CUDA" not in str(dt)):
            continue
        us = e.time_range.elapsed_us() if HAS_CUDA else e.cpu_time
        if not us:
            continue
        name = e.name
        low = name.lower()
        cat = "other"
        for c, keys in categories.items():
            if any(kw in low for kw in keys):
                cat = c
                break
        split[cat] = split.get(cat, 0.0) + us / 1e3
        top[name[:80]] = top.get(name[:80], 0.0) + us / 1e3
    top5 = dict(sorted(top.items(), key=lambda kv: -kv[1])[:8])
    return {"ms_by_category": split, "top_kernels_ms": top5}
