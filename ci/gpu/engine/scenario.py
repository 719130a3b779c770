"""Run ONE scenario of the GPU campaign in this process and write its result
as JSON (device side; driver.py starts one process per scenario, with
PYTHONPATH = the release tree (unpatched or patched) + the staged deps):

    python ci/gpu/engine/scenario.py --scenario m4 --release v0.20.2 \
        --variant unpatched --tree /root/eng/rel/v0.20.2 --json out.json

Scenarios are defined in scenarios.py. Engine scenarios build vllm.LLM from
the release's own code and compiled kernels, run the workload, and record the
outcome: "ok", "init_failed" (the engine did not start) or "run_failed" (it
died serving), with the exception's type, first line and traceback tail, the
resolved CUDA-graph mode, GPU memory after every long request, the
TurboQuant per-layer buffers (v0.20.2) and the shared workspace size, greedy
token ids and top-5 logprobs of the short prompts, and throughput.

Weights: vLLM's load_format="dummy" (the model is built and "loaded" by the
engine as usual), with its initializer replaced in-process by a
deterministic one: matrices N(0, 0.02), RMSNorm weights 1 (Gemma-style 0),
other vectors U(-1e-3, 1e-3), buffers left alone. vLLM's own dummy
initializer writes U(-1e-3, 1e-3) into every floating-point state_dict
entry, TurboQuant's persistent `_tq_centroids` buffer included (a checkpoint
load never touches it), and its near-zero weights give near-uniform logits
where greedy ties decide the tokens. With MP=1 (speed scenarios) the engine
core is a separate process and gets the replacement only if forked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scenarios as S  # noqa: E402

RESULT: dict = {}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def err_info(e: BaseException) -> dict:
    """Type, first line, and the innermost cause (EngineCore wraps)."""
    chain = []
    x: BaseException | None = e
    while x is not None and len(chain) < 6:
        msg = str(x).strip()
        chain.append(
            {
                "type": type(x).__name__,
                "first_line": msg.splitlines()[0][:500] if msg else "",
            }
        )
        x = x.__cause__ or x.__context__
    return {
        "type": type(e).__name__,
        "first_line": chain[0]["first_line"],
        "chain": chain,
        "traceback_tail": traceback.format_exc()[-4000:],
    }


def write(path: str) -> None:
    RESULT["finished"] = now()
    Path(path).write_text(json.dumps(RESULT, indent=1, default=str))
    JSON_PATH[0] = path


JSON_PATH: list[str] = [""]


def checkpoint() -> None:
    """Rewrite the result file mid-run (a timeout keeps what was measured)."""
    if JSON_PATH[0]:
        write(JSON_PATH[0])


# --------------------------------------------------------------------------
# deterministic weights (see module doc)
# --------------------------------------------------------------------------

_DONE: set[int] = set()
_COUNT = [0]


def install_weight_init() -> str:
    import torch

    try:
        import vllm.model_executor.model_loader.dummy_loader as dl
    except Exception as e:  # noqa: BLE001
        return f"vllm default (dummy_loader not patchable: {e!r})"

    def init(model, model_config, *args, **kwargs):  # noqa: ARG001
        with torch.no_grad():
            for mod in model.modules():
                cls = type(mod).__name__
                for pname, p in mod.named_parameters(recurse=False):
                    if id(p) in _DONE or p.device.type == "meta":
                        continue
                    _DONE.add(id(p))
                    if not torch.is_floating_point(p):
                        continue
                    _COUNT[0] += 1
                    g = torch.Generator(device=p.device).manual_seed(1000 + _COUNT[0])
                    if "norm" in cls.lower() and pname == "weight":
                        p.fill_(0.0 if "gemma" in cls.lower() else 1.0)
                    elif p.dim() >= 2:
                        t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                        t.normal_(0.0, 0.02, generator=g)
                        p.copy_(t)
                    else:
                        t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                        t.uniform_(-1e-3, 1e-3, generator=g)
                        p.copy_(t)

    dl.initialize_dummy_weights = init
    return "replaced: N(0,0.02) matrices, norms 1 (Gemma 0), vectors U(+-1e-3), buffers kept"


# --------------------------------------------------------------------------
# worker-side probes (collective_rpc; in-process with MP=0)
# --------------------------------------------------------------------------


def probe_memory(w) -> dict:
    import torch

    w = getattr(w, "worker", w)
    model = w.model_runner.model
    tq_attr = 0
    tq_names = set()
    centroids_ok = None
    for mod in model.modules():
        for k, v in vars(mod).items():
            if k.startswith("_tq_") and isinstance(v, torch.Tensor):
                tq_attr += v.numel() * v.element_size()
                tq_names.add(k)
        c = getattr(mod, "_tq_centroids", None)
        if centroids_ok is None and isinstance(c, torch.Tensor):
            try:
                from vllm.model_executor.layers.quantization.turboquant.centroids import (
                    get_centroids,
                )

                cfg = getattr(mod, "_tq_config", None)
                ref = get_centroids(
                    mod.head_size if hasattr(mod, "head_size") else c.shape[-1],
                    cfg.centroid_bits,
                ).to(c.device, c.dtype)
                centroids_ok = bool(torch.allclose(c, ref))
            except Exception as e:  # noqa: BLE001
                centroids_ok = f"unknown: {e!r}"[:200]
    ws = None
    try:
        from vllm.v1.worker import workspace as wsm

        if wsm.is_workspace_manager_initialized():
            m = wsm.current_workspace_manager()
            ws = sum(
                t.numel() * t.element_size()
                for t in m._current_workspaces
                if t is not None
            )
    except Exception as e:  # noqa: BLE001
        ws = f"n/a: {e!r}"[:200]
    torch.cuda.synchronize()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "tq_layer_tensor_bytes": tq_attr,  # dynamic _tq_* attributes (not buffers)
        "tq_layer_tensor_names": sorted(tq_names),
        "workspace_bytes": ws,
        "centroids_ok": centroids_ok,
    }


def probe_config(w) -> dict:
    w = getattr(w, "worker", w)
    out = {}
    try:
        vc = w.vllm_config
        cc = vc.compilation_config
        out["cudagraph_mode"] = str(cc.cudagraph_mode)
        out["compilation_mode"] = str(getattr(cc, "mode", getattr(cc, "level", None)))
        out["capture_sizes"] = list(cc.cudagraph_capture_sizes or [])
        out["flash_attn_version"] = getattr(
            vc.attention_config, "flash_attn_version", None
        )
        out["block_size"] = vc.cache_config.block_size
        out["num_gpu_blocks"] = vc.cache_config.num_gpu_blocks
        out["max_num_batched_tokens"] = vc.scheduler_config.max_num_batched_tokens
        out["chunked_prefill"] = vc.scheduler_config.enable_chunked_prefill
        out["prefix_caching"] = vc.cache_config.enable_prefix_caching
        out["async_scheduling"] = getattr(vc.scheduler_config, "async_scheduling", None)
        out["kv_skip_layers"] = getattr(
            vc.cache_config, "kv_cache_dtype_skip_layers", None
        )
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)[:300]
    try:
        backends = {}
        for name, layer in w.model_runner.model.named_modules():
            impl = getattr(layer, "impl", None)
            if impl is not None and hasattr(layer, "kv_cache_dtype"):
                backends[name] = f"{type(impl).__name__}/{layer.kv_cache_dtype}"
        out["attention_impls"] = backends
    except Exception as e:  # noqa: BLE001
        out["attention_impls_error"] = repr(e)[:300]
    return out


def probe_weights(w) -> str:
    """Digest of the model's parameters: engines compared token for token
    must hold the same (deterministic) weights."""
    import hashlib

    import torch

    w = getattr(w, "worker", w)
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in w.model_runner.model.named_parameters():
            d = p.detach().double()
            h.update(
                f"{name}:{tuple(p.shape)}:{d.sum().item():.6e}:{d.abs().sum().item():.6e};".encode()
            )
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------


def run_import(res: dict) -> None:
    t = time.time()
    import torch

    res["torch"] = torch.__version__
    res["cuda"] = torch.version.cuda
    res["gpu"] = torch.cuda.get_device_name(0)
    import vllm

    res["vllm"] = vllm.__version__
    res["vllm_file"] = vllm.__file__
    from vllm import LLM, SamplingParams  # noqa: F401

    res["import_s"] = round(time.time() - t, 2)
    from vllm.platforms import current_platform

    res["platform"] = type(current_platform).__name__
    res["capability"] = str(current_platform.get_device_capability())
    checks: dict = {}
    check_rms_norm(checks)
    check_flash_attn(checks)
    try:
        from vllm.v1.attention.backends import turboquant_attn as tq

        checks["turboquant_attn._HAS_FLASH_ATTN"] = bool(tq._HAS_FLASH_ATTN)
    except Exception as e:  # noqa: BLE001
        checks["turboquant_attn"] = f"FAILED {e!r}"[:300]
    for mod in ("numba", "xgrammar", "llguidance", "triton"):
        try:
            m = __import__(mod)
            checks[f"{mod}_version"] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            checks[mod] = f"FAILED {e!r}"[:200]
    res["checks"] = checks
    bad = [
        k for k, v in checks.items() if isinstance(v, str) and v.startswith("FAILED")
    ]
    res["outcome"] = "ok" if not bad else "failed"
    if bad:
        res["error"] = {
            "type": "CheckFailed",
            "first_line": "; ".join(f"{k}: {checks[k]}" for k in bad)[:500],
        }


def check_rms_norm(checks: dict) -> None:
    """vllm._C's rms_norm against PyTorch (the compiled ops load and run)."""
    import torch

    try:
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w, 1e-6)
        ref = (
            x.float()
            * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            * w.float()
        )
        checks["_C.rms_norm_max_abs_err"] = float((out.float() - ref).abs().max())
    except Exception as e:  # noqa: BLE001
        checks["_C.rms_norm"] = f"FAILED {e!r}"[:300]


def check_flash_attn(checks: dict) -> None:
    """The wheel's FA2 and FA3 availability, and FA2's varlen attention
    against PyTorch's SDPA."""
    import torch

    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai

        checks["FA2"] = [fai.FA2_AVAILABLE, (fai.FA2_UNAVAILABLE_REASON or "")[:200]]
        checks["FA3"] = [fai.FA3_AVAILABLE, (fai.FA3_UNAVAILABLE_REASON or "")[:200]]
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        q = torch.randn(300, 16, 256, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(300, 4, 256, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
        r = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        ).transpose(0, 1)
        o = flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=300,
            max_seqlen_k=300,
            causal=True,
            fa_version=2,
        )
        o = o[0] if isinstance(o, tuple) else o
        checks["FA2_varlen_max_abs_err_vs_sdpa"] = float(
            (o.float() - r.float()).abs().max()
        )
    except Exception as e:  # noqa: BLE001
        checks["FA2_varlen"] = f"FAILED {e!r}"[:300]


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as e:  # noqa: BLE001
        return f"? {e!r}"[:100]


def gen(llm, prompts, sp):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def run_engine(name: str, res: dict) -> None:
    """One engine scenario: the engine started and probed, then its
    workload."""
    s = S.SCENARIOS[name]
    res["weights"] = install_weight_init()  # imports torch
    import vllm
    from vllm import LLM, SamplingParams

    res["vllm"] = vllm.__version__
    llm = start_engine(LLM, name, res)
    if llm is None:
        return
    if s["workload"] == "none":
        res["outcome"] = "ok"
    elif s["workload"] in ("prefix_batch", "spec_eq"):
        run_eq(llm, s["workload"], res, SamplingParams)
    elif s["workload"] == "speed":
        run_speed_alone(llm, res, SamplingParams)
    else:
        run_std(llm, s, res, SamplingParams)


def start_engine(LLM, name: str, res: dict):
    """vllm.LLM with the scenario's engine arguments (None if it did not
    start: init_failed), its config and GPU memory once started."""
    # (no CUDA call before LLM(): with MP=1 vLLM would switch the engine-core
    # process from fork to spawn)
    kw = S.engine_kwargs(name)
    res["engine_kwargs"] = kw
    res["phase"] = "init"
    t0 = time.time()
    try:
        llm = LLM(**kw)
    except BaseException as e:  # noqa: BLE001
        res["init_s"] = round(time.time() - t0, 1)
        res["outcome"] = "init_failed"
        res["error"] = err_info(e)
        res["gpu"] = gpu_name()
        return None
    res["init_s"] = round(time.time() - t0, 1)
    res["gpu"] = gpu_name()
    try:
        res["config"] = llm.collective_rpc(probe_config)[0]
        res["mem_after_init"] = llm.collective_rpc(probe_memory)[0]
    except Exception as e:  # noqa: BLE001
        res["probe_error"] = repr(e)[:300]
    return llm


def run_speed_alone(llm, res: dict, SamplingParams) -> None:
    """The throughput workload, then the engine-core process stopped (MP=1)."""
    res["phase"] = "speed"
    try:
        run_speed(llm, res, SamplingParams)
        res["outcome"] = "ok"
    except BaseException as e:  # noqa: BLE001
        res["outcome"] = "run_failed"
        res["error"] = err_info(e)
    try:
        llm.llm_engine.engine_core.shutdown()  # MP=1: stop the engine-core process
    except Exception:  # noqa: BLE001
        pass


def run_std(llm, s: dict, res: dict, SamplingParams) -> None:
    """The standard workload: short prompts (greedy tokens, logprobs), then
    the continuation requests with GPU memory after the measured ones."""
    res["phase"] = "short"
    sp = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False, logprobs=5
    )
    try:
        t = time.time()
        outs = gen(llm, S.short_prompts(), sp)
        res["short_s"] = round(time.time() - t, 2)
        res["short"] = [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [
                    {
                        str(tid): round(float(lp.logprob), 5)
                        for tid, lp in (d or {}).items()
                    }
                    for d in (o.outputs[0].logprobs or [])
                ],
            }
            for o in outs
        ]
    except BaseException as e:  # noqa: BLE001
        res["outcome"] = "run_failed"
        res["error"] = err_info(e)
        return
    res["phase"] = "long"
    res["long"] = []
    sp_long = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False
    )
    for req in S.long_requests(s["prefix"]):
        row = {
            "label": req["label"],
            "ctx": req["ctx"],
            "prompt_len": len(req["prompt"]),
        }
        res["long"].append(row)
        try:
            t = time.time()
            o = gen(llm, [req["prompt"]], sp_long)[0]
            row["s"] = round(time.time() - t, 3)
            row["num_cached_tokens"] = getattr(o, "num_cached_tokens", None)
            row["out"] = list(o.outputs[0].token_ids)
            if req["measure"]:
                row["mem"] = llm.collective_rpc(probe_memory)[0]
        except BaseException as e:  # noqa: BLE001
            res["outcome"] = "run_failed"
            res["error"] = err_info(e)
            row["failed"] = True
            return
    res["outcome"] = "ok"


def record(o, prompt: list[int] | None = None, tail: int = 0) -> dict:
    """Greedy tokens, top-k logprobs, cached tokens; with ``tail``, the
    logprob of each of the prompt's last ``tail`` tokens (prompt logprobs,
    aligned from the end; None where the entry lacks the prompt's token)."""
    c = o.outputs[0]
    r = {
        "token_ids": list(c.token_ids),
        "logprobs": [
            {str(t): round(float(lp.logprob), 5) for t, lp in (d or {}).items()}
            for d in (c.logprobs or [])
        ],
        "num_cached_tokens": getattr(o, "num_cached_tokens", None),
    }
    if tail:
        plp = o.prompt_logprobs or []
        r["prompt_lp"] = []
        for j in range(tail, 0, -1):
            d = plp[-j] if j < len(plp) else None
            lp = d.get(prompt[-j]) if d else None
            r["prompt_lp"].append(None if lp is None else round(float(lp.logprob), 5))
    return r


def run_prefix_batch(llm, res: dict, SamplingParams) -> None:
    """vllm#46460 (PFX): H = P + tail with P cached, alone, then in one step
    with a fresh prompt F longer than H. The oracle is H alone."""
    c = S.PFX
    sp_p = SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False
    )
    kw = {
        "temperature": 0.0,
        "max_tokens": c["max_tokens"],
        "ignore_eos": True,
        "detokenize": False,
        "logprobs": 5,
    }
    # prompt logprobs skip the prefix cache unless told not to (sampling_params.py)
    sp_h = SamplingParams(**kw, prompt_logprobs=1, skip_reading_prefix_cache=False)
    sp_f = SamplingParams(**kw)
    res["trials"] = []
    for t in S.pfx_trials():
        row: dict = {"seed": t["seed"]}
        res["trials"].append(row)
        h = t["P"] + t["tail"]
        m = c["tail"] - 1  # tail tokens whose logprob the tail's own positions give
        gen(llm, [t["P"]], sp_p)
        row["alone"] = record(gen(llm, [h], sp_h)[0], h, m)
        row["reset"] = [llm.reset_prefix_cache()]
        gen(llm, [t["P"]], sp_p)
        oh, of = llm.generate(
            [{"prompt_token_ids": h}, {"prompt_token_ids": t["F"]}],
            [sp_h, sp_f],
            use_tqdm=False,
        )
        row["batched"] = record(oh, h, m)
        row["fresh"] = record(of)
        row["reset"].append(llm.reset_prefix_cache())
        checkpoint()


def spec_counters(llm) -> dict:
    """The engine's speculative-decoding counters (Prometheus snapshot)."""
    try:
        ms = llm.get_metrics()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}
    out = {}
    for m in ms:
        if "spec_decode" in m.name:
            v = getattr(m, "value", None)
            out[m.name] = v if v is not None else list(getattr(m, "values", []) or [])
    return out


def run_spec_eq(llm, res: dict, SamplingParams) -> None:
    """Greedy outputs of spec_prompts, one at a time and then all at once,
    with the time each took and the speculative-decoding counters."""
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=S.SPEC_TOKENS,
        ignore_eos=True,
        detokenize=False,
        logprobs=5,
    )
    warm = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False
    )
    prompts = S.spec_prompts()
    gen(llm, [S.random_tokens(48, 99)], warm)
    res["spec_counters"] = {"start": spec_counters(llm)}
    res["spec_bs1"] = []
    for pr in prompts:
        t = time.perf_counter()
        o = gen(llm, [pr], sp)[0]
        res["spec_bs1"].append({**record(o), "s": round(time.perf_counter() - t, 4)})
        checkpoint()
    res["spec_counters"]["bs1"] = spec_counters(llm)
    times = []
    for i in range(2):  # timed twice: the first batch may meet new shapes
        t = time.perf_counter()
        outs = gen(llm, prompts, sp)
        times.append(round(time.perf_counter() - t, 4))
        if i == 0:
            res["spec_batch"] = {"outputs": [record(o) for o in outs]}
            res["spec_counters"]["batch"] = spec_counters(llm)
    res["spec_batch"].update(s=min(times), s_each=times)
    n1 = sum(len(x["token_ids"]) for x in res["spec_bs1"])
    nb = sum(len(x["token_ids"]) for x in res["spec_batch"]["outputs"])
    res["eq_speed"] = {
        "bs1_tok_per_s": round(n1 / sum(x["s"] for x in res["spec_bs1"]), 1),
        f"bs{len(prompts)}_tok_per_s": round(nb / res["spec_batch"]["s"], 1),
    }


def run_eq(llm, workload: str, res: dict, SamplingParams) -> None:
    res["phase"] = workload
    try:
        res["weights_digest"] = llm.collective_rpc(probe_weights)[0]
    except Exception as e:  # noqa: BLE001
        res["weights_digest"] = f"n/a: {e!r}"[:200]
    checkpoint()
    try:
        (run_prefix_batch if workload == "prefix_batch" else run_spec_eq)(
            llm, res, SamplingParams
        )
        res["outcome"] = "ok"
    except BaseException as e:  # noqa: BLE001
        res["outcome"] = "run_failed"
        res["error"] = err_info(e)


def run_speed(llm, res: dict, SamplingParams) -> None:
    sp = SamplingParams(
        temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False
    )
    warm = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False
    )
    res["speed"] = {}
    for bs in (1, 32):
        prompts = [S.random_tokens(32, 5000 + i) for i in range(bs)]
        gen(llm, prompts, warm)
        reps = []
        for _ in range(3 if bs == 1 else 2):
            t = time.perf_counter()
            outs = gen(llm, prompts, sp)
            dt = time.perf_counter() - t
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            reps.append(
                {"s": round(dt, 4), "tokens": ntok, "tok_per_s": round(ntok / dt, 1)}
            )
        best = max(r["tok_per_s"] for r in reps)
        res["speed"][f"bs{bs}"] = {
            "reps": reps,
            "best_tok_per_s": best,
            "prompt_len": 32,
            "max_tokens": 256,
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--release", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--tree", default="")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    s = S.SCENARIOS[a.scenario]
    RESULT.update(
        scenario=a.scenario,
        release=a.release,
        variant=a.variant,
        tree=a.tree,
        kind=s["kind"],
        doc=s.get("doc", ""),
        started=now(),
        outcome="incomplete",
        host=os.uname().nodename,
    )
    if s["kind"] == "engine":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(s["mp"])
        os.environ.update(S.engine_env(a.scenario))
        RESULT["env"] = S.engine_env(a.scenario)
    write(a.json)  # a crash or a timeout still leaves a record
    if os.environ.get("ENG_FAKE"):  # a dry run: fakes.py's synthetic result
        import fakes

        fakes.fake(RESULT, a.scenario, a.release, a.variant)
        write(a.json)
        print(
            f"[scenario] FAKE {a.release}/{a.variant}/{a.scenario}: {RESULT.get('outcome')}",
            flush=True,
        )
        os._exit(0)
    try:
        if a.tree:
            sys.path.insert(0, a.tree)
        import vllm

        got = Path(vllm.__file__).resolve()
        RESULT["vllm_file"] = str(got)
        if a.tree and Path(a.tree).resolve() not in got.parents:
            raise RuntimeError(f"vllm imported from {got}, not from {a.tree}")
        if s["kind"] == "import":
            run_import(RESULT)
        elif s["kind"] == "cont_bench":
            import cont_bench

            cont_bench.run(RESULT, a.release, a.variant, a.tree, a.json)
        else:
            run_engine(a.scenario, RESULT)
    except BaseException as e:  # noqa: BLE001
        RESULT["outcome"] = "error"
        RESULT["error"] = err_info(e)
    write(a.json)
    print(
        f"[scenario] {a.release}/{a.variant}/{a.scenario}: {RESULT.get('outcome')}"
        + (
            f" -- {RESULT['error']['type']}: {RESULT['error']['first_line'][:200]}"
            if RESULT.get("error")
            else ""
        ),
        flush=True,
    )
    sys.stdout.flush()
    # The engine may leave threads / a process group behind: exit hard.
    os._exit(0)


if __name__ == "__main__":
    main()
