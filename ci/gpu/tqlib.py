"""Shared helpers of the GPU scripts in ci/gpu/: import vLLM from a plain source
tree (no compiled extensions), build a TurboQuant attention impl, layer and
metadata builder the way tests/patches/ does, fill a TurboQuant cache with
valid data, time calls with CUDA events, and stand in for flash-attn.

Every script runs ONE tree per process (``--tree DIR``, the directory holding
``vllm/``): a failed CUDA-graph capture can poison the CUDA context, and two
trees cannot share ``sys.modules``.

On a CPU-only box (sanity checks before a GPU call) the same code runs with
``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` (set here when torch
sees no GPU) on small shapes.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TQ_MODULE = "vllm.v1.attention.backends.turboquant_attn"


def use_tree(tree: str | Path) -> SimpleNamespace:
    """Put ``tree`` first on sys.path, install the platform, import the
    TurboQuant backend; returns the modules the scripts use."""
    tree = Path(tree).resolve()
    if not (tree / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"{tree}: no vllm/__init__.py")
    sys.path.insert(0, str(tree))
    import importlib

    import vllm
    import vllm.platforms as platforms

    got = Path(vllm.__file__).resolve()
    assert tree in got.parents, f"vllm imported from {got}, not from {tree}"
    # An uninstalled tree detects no platform (it reads the installed
    # package's metadata): install one, as tests/patches/conftest.py does.
    # CudaPlatform needs vLLM's compiled extensions (vllm._C, and
    # vllm.vllm_flash_attn, which fa_utils imports on CUDA); a source tree
    # has none, so it runs on CpuPlatform with its tensors and Triton
    # kernels on the GPU (what a source tree gets on the device anyway:
    # GPU.md). Consequences: _HAS_FLASH_ATTN is False, merge_attn_states
    # takes vLLM's Triton kernel.
    if HAS_CUDA and any((tree / "vllm").glob("_C.*so")):
        from vllm.platforms.cuda import CudaPlatform as Platform
    else:
        from vllm.platforms.cpu import CpuPlatform as Platform  # type: ignore
    platforms._current_platform = Platform()
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]

    from vllm.config import SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker import workspace

    tqa = importlib.import_module(TQ_MODULE)
    return SimpleNamespace(
        tree=tree,
        tqa=tqa,
        workspace=workspace,
        VllmConfig=VllmConfig,
        SchedulerConfig=SchedulerConfig,
        set_config=set_current_vllm_config,
        get_centroids=get_centroids,
        CAM=CommonAttentionMetadata,
        has_flash_attn=bool(tqa._HAS_FLASH_ATTN),
    )


def make_config(
    env: SimpleNamespace, *, max_num_batched_tokens: int, max_model_len: int
):
    sched = env.SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_num_seqs=64,
        is_encoder_decoder=False,
    )
    return env.VllmConfig(scheduler_config=sched)


def make_impl(env, config, preset: str, hq: int, hk: int, d: int) -> Any:
    with env.set_config(config):
        return env.tqa.TurboQuantAttentionImpl(
            num_heads=hq,
            head_size=d,
            scale=d**-0.5,
            num_kv_heads=hk,
            kv_cache_dtype=preset,
        )


def make_layer(env, impl, d: int) -> torch.nn.Module:
    # The engine's Attention layer registers the centroids as a buffer, so
    # they live on the GPU.
    layer = torch.nn.Module()
    c = env.get_centroids(d, impl.tq_config.centroid_bits)
    layer.register_buffer("_tq_centroids", c.to(DEVICE))
    return layer


def make_builder(env, config, block_size: int, hk: int, d: int) -> Any:
    spec = SimpleNamespace(block_size=block_size, num_kv_heads=hk, head_size=d)
    return env.tqa.TurboQuantMetadataBuilder(spec, ["layer.0"], config, DEVICE)


def workspace_bytes(env) -> int:
    ws = env.workspace
    if not ws.is_workspace_manager_initialized():
        return 0
    t = ws.current_workspace_manager()._current_workspaces[0]
    return 0 if t is None else t.numel() * t.element_size()


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
    """A TurboQuant cache holding whole requests at random block ids."""

    def __init__(self, env, impl, layer, preset, hk, d, block_size, seqs, seed):
        self.env, self.impl, self.layer = env, impl, layer
        self.hk, self.d, self.bs = hk, d, block_size
        shape = env.tqa.TurboQuantAttentionBackend.get_kv_cache_shape(
            0, block_size, hk, d, preset
        )
        nblk = [math.ceil(s / block_size) for s in seqs]
        total = sum(nblk) + 1
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        # Random bytes: a slot nobody wrote reads as garbage.
        self.kv_cache = torch.randint(
            0, 256, (total, *shape[1:]), dtype=torch.uint8, device=DEVICE, generator=g
        )
        self.slot_bytes = shape[-1]
        perm = torch.randperm(total, device=DEVICE, generator=g)
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


def make_cam(env, paged: Paged, rows: list[int], cached: list[int], qlens: list[int]):
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
    return env.CAM(
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


def _math_varlen(q, k, v, cu_q, cu_k, scale, causal):
    """fp32 reference of flash-attn varlen (bottom-right causal), for CPU."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    hq, hk = q.shape[1], k.shape[1]
    for i in range(len(cq) - 1):
        qi = q[cq[i] : cq[i + 1]].float().transpose(0, 1)
        ki = k[ck[i] : ck[i + 1]].float().repeat_interleave(hq // hk, 1).transpose(0, 1)
        vi = v[ck[i] : ck[i + 1]].float().repeat_interleave(hq // hk, 1).transpose(0, 1)
        s = qi @ ki.transpose(1, 2) * scale
        if causal:
            lq, lk = qi.shape[1], ki.shape[1]
            qp = torch.arange(lq).unsqueeze(1) + (lk - lq)
            s = s.masked_fill(torch.arange(lk).unsqueeze(0) > qp, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.exp(s - lse.unsqueeze(-1)) @ vi).transpose(0, 1).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def flash_attn_varlen_shim(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    return_softmax_lse=False,
    return_attn_probs=False,
    fa_version=None,
    out=None,
    **_: Any,
):
    """vllm_flash_attn's ``flash_attn_varlen_func`` on PyTorch's own FA2
    (``aten._flash_attention_forward``: varlen, GQA, bottom-right causal,
    LSE (Hq, total_q)); CPU: an fp32 math stand-in."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if q.is_cuda:
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            0.0, causal, False, scale=scale,
        )  # fmt: skip
        o, lse = res[0], res[1]
        if lse.dim() == 3:  # padded (batch, heads, max_q): one sequence here
            lse = lse[0, :, : q.shape[0]]
    else:
        o, lse = _math_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    if out is not None:
        out.copy_(o)
        o = out
    if return_softmax_lse:
        return o, lse
    if return_attn_probs:
        return o, lse, None
    return o


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
    """The stand-in against fp32 math: GQA, bottom-right causal, LSE."""
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
        ro, rl = _math_varlen(
            q.cpu(), k.cpu(), v.cpu(), cq.cpu(), ck.cpu(), 256**-0.5, causal
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
    t = time_calls(lambda: dst.copy_(src), 0.3, 10, 10)
    bw = 2 * n / (t["median_ms"] * 1e-3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t2 = time_calls(lambda: a @ b, 0.3, 10, 10)
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
