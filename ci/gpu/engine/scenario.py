"""Run ONE engine scenario in this process and write its result as JSON
(device side; driver.py starts one process per job, with PYTHONPATH = the
release tree (unpatched or a variant) + the staged deps):

    python ci/gpu/engine/scenario.py --scenario m4 --release v0.20.2 \\
        --variant unpatched --tree /root/eng/rel/v0.20.2 --json out.json

Scenarios are defined in scenarios.py. An engine scenario builds vllm.LLM
from the release's own code and compiled kernels, runs its workload and
records the outcome: "ok", "init_failed" (the engine did not start) or
"run_failed" (it died serving), with the exception's chain, GPU memory after
every long request (TurboQuant's per-layer buffers on v0.20.2, the shared
workspace), greedy token ids and top-5 logprobs, and throughput.
"cont_bench" runs cont_bench.py instead. ENG_FAKE=1: no vLLM, outcome "ok"
(a dry run of the rig on a CPU).

Weights: vLLM's load_format="dummy" with its initializer replaced
in-process by a deterministic one: matrices N(0, 0.02), RMSNorm weights 1
(Gemma-style 0), other vectors U(-1e-3, 1e-3), buffers left alone. vLLM's
own writes U(-1e-3, 1e-3) into every floating-point state_dict entry,
TurboQuant's `_tq_centroids` buffer included, and its near-zero weights give
near-uniform logits where greedy ties decide the tokens. With MP=1 (speed
scenarios) the engine core is a separate process and gets the replacement
only if forked.
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
JSON_PATH: list[str] = [""]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def err_info(e: BaseException) -> dict:
    """Type, first line, and the chain of causes (EngineCore wraps)."""
    chain = []
    x: BaseException | None = e
    while x is not None and len(chain) < 6:
        msg = str(x).strip()
        chain.append({"type": type(x).__name__,
                      "first_line": msg.splitlines()[0][:500] if msg else ""})  # fmt: skip
        x = x.__cause__ or x.__context__
    return {"type": type(e).__name__, "first_line": chain[0]["first_line"],
            "chain": chain, "traceback_tail": traceback.format_exc()[-4000:]}  # fmt: skip


def checkpoint() -> None:
    """(Re)write the result file: a crash or a timeout keeps what was
    measured."""
    RESULT["finished"] = now()
    Path(JSON_PATH[0]).write_text(json.dumps(RESULT, indent=1, default=str))


def failed(res: dict, outcome: str, e: BaseException) -> None:
    res["outcome"], res["error"] = outcome, err_info(e)


# --------------------------------------------------------------------------
# deterministic weights (see module doc)
# --------------------------------------------------------------------------


def install_weight_init() -> str:
    import torch

    try:
        import vllm.model_executor.model_loader.dummy_loader as dl
    except Exception as e:  # noqa: BLE001
        return f"vllm default (dummy_loader not patchable: {e!r})"
    done: set[int] = set()
    count = [0]  # floating-point parameters seen: each one's seed

    def init(model, model_config, *args, **kwargs):  # noqa: ARG001
        with torch.no_grad():
            for mod in model.modules():
                cls = type(mod).__name__.lower()
                for pname, p in mod.named_parameters(recurse=False):
                    if id(p) in done or p.device.type == "meta":
                        continue
                    done.add(id(p))
                    if not torch.is_floating_point(p):
                        continue
                    count[0] += 1
                    if "norm" in cls and pname == "weight":
                        p.fill_(0.0 if "gemma" in cls else 1.0)
                        continue
                    g = torch.Generator(device=p.device).manual_seed(1000 + count[0])
                    t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    if p.dim() >= 2:
                        t.normal_(0.0, 0.02, generator=g)
                    else:
                        t.uniform_(-1e-3, 1e-3, generator=g)
                    p.copy_(t)

    dl.initialize_dummy_weights = init
    return "replaced: N(0,0.02) matrices, norms 1 (Gemma 0), vectors U(+-1e-3), buffers kept"


# --------------------------------------------------------------------------
# worker-side probes (collective_rpc; in-process with MP=0)
# --------------------------------------------------------------------------


def probe_memory(w) -> dict:
    """GPU memory, TurboQuant's per-layer tensors (v0.20.2 hangs its dequant
    buffers on the layers as _tq_* attributes) and the shared workspace."""
    import torch

    w = getattr(w, "worker", w)
    tq = 0
    for mod in w.model_runner.model.modules():
        tq += sum(v.numel() * v.element_size() for k, v in vars(mod).items()
                  if k.startswith("_tq_") and isinstance(v, torch.Tensor))  # fmt: skip
    ws = None
    try:
        from vllm.v1.worker import workspace as wsm

        if wsm.is_workspace_manager_initialized():
            bufs = wsm.current_workspace_manager()._current_workspaces
            ws = sum(t.numel() * t.element_size() for t in bufs if t is not None)
    except Exception as e:  # noqa: BLE001
        ws = f"n/a: {e!r}"[:200]
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "tq_layer_tensor_bytes": tq, "workspace_bytes": ws}  # fmt: skip


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
            h.update(f"{name}:{tuple(p.shape)}:{d.sum().item():.6e}:"
                     f"{d.abs().sum().item():.6e};".encode())  # fmt: skip
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------
# the engine and its workloads
# --------------------------------------------------------------------------


def greedy(SamplingParams, max_tokens: int, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False, **kw)  # fmt: skip


def gen(llm, prompts, sp):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def run_engine(name: str, res: dict) -> None:
    """One engine scenario: the engine started and probed, then its
    workload (a failure recorded as run_failed)."""
    s = S.SCENARIOS[name]
    res["weights"] = install_weight_init()  # imports torch
    import vllm
    from vllm import LLM, SamplingParams

    res["vllm"] = vllm.__version__
    llm = start_engine(LLM, name, res)
    if llm is None:
        return
    workload = {"none": lambda *a: None, "std": run_std, "speed": run_speed,
                "prefix_batch": run_prefix_batch, "spec_eq": run_spec_eq}[s["workload"]]  # fmt: skip
    res["phase"] = s["workload"]
    try:
        if s["workload"] in ("prefix_batch", "spec_eq"):
            res["weights_digest"] = llm.collective_rpc(probe_weights)[0]
            checkpoint()
        workload(llm, res, SamplingParams)
        res["outcome"] = "ok"
    except BaseException as e:  # noqa: BLE001
        failed(res, "run_failed", e)
    if s["mp"]:
        try:
            llm.llm_engine.engine_core.shutdown()  # MP=1: stop the engine-core process
        except Exception:  # noqa: BLE001
            pass


def start_engine(LLM, name: str, res: dict):
    """vllm.LLM with the scenario's engine arguments (None if it did not
    start: init_failed), its GPU memory once started."""
    # (no CUDA call before LLM(): with MP=1 vLLM would switch the engine-core
    # process from fork to spawn)
    kw = S.engine_kwargs(name)
    res["engine_kwargs"], res["phase"] = kw, "init"
    t0 = time.time()
    try:
        llm = LLM(**kw)
    except BaseException as e:  # noqa: BLE001
        failed(res, "init_failed", e)
        llm = None
    res["init_s"] = round(time.time() - t0, 1)
    import torch

    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    if llm is not None:
        try:
            res["mem_after_init"] = llm.collective_rpc(probe_memory)[0]
        except Exception as e:  # noqa: BLE001
            res["probe_error"] = repr(e)[:300]
    return llm


def record(o, prompt: list[int] | None = None, tail: int = 0) -> dict:
    """Greedy tokens, top-k logprobs, cached tokens; with ``tail``, the
    logprob of each of the prompt's last ``tail`` tokens (prompt logprobs,
    aligned from the end; None where the entry lacks the prompt's token)."""
    c = o.outputs[0]
    r = {"token_ids": list(c.token_ids),
         "logprobs": [{str(t): round(float(lp.logprob), 5) for t, lp in (d or {}).items()}
                      for d in (c.logprobs or [])],
         "num_cached_tokens": getattr(o, "num_cached_tokens", None)}  # fmt: skip
    if tail:
        plp = o.prompt_logprobs or []
        r["prompt_lp"] = []
        for j in range(tail, 0, -1):
            d = plp[-j] if j < len(plp) else None
            lp = d.get(prompt[-j]) if d else None
            r["prompt_lp"].append(None if lp is None else round(float(lp.logprob), 5))
    return r


def run_std(llm, res: dict, SamplingParams) -> None:
    """Short prompts (greedy tokens, logprobs), then the continuation
    requests with GPU memory after the measured ones."""
    res["phase"] = "short"
    t = time.time()
    outs = gen(llm, S.short_prompts(), greedy(SamplingParams, 32, logprobs=5))
    res["short_s"] = round(time.time() - t, 2)
    res["short"] = [record(o) for o in outs]
    res["phase"], res["long"] = "long", []
    for req in S.long_requests(S.SCENARIOS[res["scenario"]]["prefix"]):
        row = {"label": req["label"], "ctx": req["ctx"], "prompt_len": len(req["prompt"])}
        res["long"].append(row)
        row["failed"] = True
        t = time.time()
        o = gen(llm, [req["prompt"]], greedy(SamplingParams, 4))[0]
        row.update(s=round(time.time() - t, 3), out=list(o.outputs[0].token_ids),
                   num_cached_tokens=getattr(o, "num_cached_tokens", None))  # fmt: skip
        del row["failed"]
        if req["measure"]:
            row["mem"] = llm.collective_rpc(probe_memory)[0]


def run_prefix_batch(llm, res: dict, SamplingParams) -> None:
    """vllm#46460 (S.PFX): H = P + tail with P cached, alone, then in one
    step with a fresh prompt F longer than H. The oracle is H alone."""
    c = S.PFX
    prime = greedy(SamplingParams, 1)
    # prompt logprobs skip the prefix cache unless told not to (sampling_params.py)
    sp_h = greedy(SamplingParams, c["max_tokens"], logprobs=5, prompt_logprobs=1,
                  skip_reading_prefix_cache=False)  # fmt: skip
    sp_f = greedy(SamplingParams, c["max_tokens"], logprobs=5)
    res["trials"] = []
    for t in S.pfx_trials():
        row: dict = {"seed": t["seed"]}
        res["trials"].append(row)
        h = t["P"] + t["tail"]
        m = c["tail"] - 1  # tail tokens whose logprob the tail's own positions give
        gen(llm, [t["P"]], prime)
        row["alone"] = record(gen(llm, [h], sp_h)[0], h, m)
        row["reset"] = [llm.reset_prefix_cache()]
        gen(llm, [t["P"]], prime)
        oh, of = llm.generate([{"prompt_token_ids": h}, {"prompt_token_ids": t["F"]}],
                              [sp_h, sp_f], use_tqdm=False)  # fmt: skip
        row["batched"], row["fresh"] = record(oh, h, m), record(of)
        row["reset"].append(llm.reset_prefix_cache())
        checkpoint()


def spec_counters(llm) -> dict:
    """The engine's speculative-decoding counters (Prometheus snapshot)."""
    try:
        ms = llm.get_metrics()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}
    return {m.name: m.value if getattr(m, "value", None) is not None
            else list(getattr(m, "values", []) or [])
            for m in ms if "spec_decode" in m.name}  # fmt: skip


def run_spec_eq(llm, res: dict, SamplingParams) -> None:
    """Greedy outputs of S.spec_prompts, one at a time and then all at
    once, with the time each took and the speculative-decoding counters."""
    sp = greedy(SamplingParams, S.SPEC_TOKENS, logprobs=5)
    prompts = S.spec_prompts()
    gen(llm, [S.random_tokens(48, 99)], greedy(SamplingParams, 32))
    res["spec_counters"], res["spec_bs1"] = {"start": spec_counters(llm)}, []
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


def run_speed(llm, res: dict, SamplingParams) -> None:
    """Decode throughput: 32-token prompts, 256 greedy tokens, batch 1 and
    32, the best of 3 (2) runs after a warm-up."""
    res["speed"] = {}
    for bs in (1, 32):
        prompts = [S.random_tokens(32, 5000 + i) for i in range(bs)]
        gen(llm, prompts, greedy(SamplingParams, 16))
        reps = []
        for _ in range(3 if bs == 1 else 2):
            t = time.perf_counter()
            outs = gen(llm, prompts, greedy(SamplingParams, 256))
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            reps.append({"s": round(dt, 4), "tokens": n, "tok_per_s": round(n / dt, 1)})
        res["speed"][f"bs{bs}"] = {"reps": reps, "prompt_len": 32, "max_tokens": 256,
                                   "best_tok_per_s": max(r["tok_per_s"] for r in reps)}  # fmt: skip


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def run(a: argparse.Namespace) -> None:
    """The scenario against the tree (checked to be the vLLM imported)."""
    if os.environ.get("ENG_FAKE"):  # a dry run of the rig
        RESULT["outcome"] = "ok"
        return
    if a.tree:
        sys.path.insert(0, a.tree)
    import vllm

    got = Path(vllm.__file__).resolve()
    RESULT["vllm_file"] = str(got)
    if a.tree and Path(a.tree).resolve() not in got.parents:
        raise RuntimeError(f"vllm imported from {got}, not from {a.tree}")
    if S.SCENARIOS[a.scenario]["kind"] == "cont_bench":
        import cont_bench

        cont_bench.run(RESULT, a.release, a.variant, a.tree, a.json)
    else:
        run_engine(a.scenario, RESULT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for opt in ("--scenario", "--release", "--variant", "--json"):
        ap.add_argument(opt, required=True)
    ap.add_argument("--tree", default="")
    a = ap.parse_args()
    s = S.SCENARIOS[a.scenario]
    JSON_PATH[0] = a.json
    RESULT.update(scenario=a.scenario, release=a.release, variant=a.variant,
                  tree=a.tree, kind=s["kind"], doc=s.get("doc", ""), started=now(),
                  outcome="incomplete", host=os.uname().nodename)  # fmt: skip
    if s["kind"] == "engine":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(s["mp"])
        RESULT["env"] = S.engine_env(a.scenario)
        os.environ.update(RESULT["env"])
    checkpoint()
    try:
        run(a)
    except BaseException as e:  # noqa: BLE001
        failed(RESULT, "error", e)
    checkpoint()
    e = RESULT.get("error")
    print(f"[scenario] {a.release}/{a.variant}/{a.scenario}: {RESULT.get('outcome')}"
          + (f" -- {e['type']}: {e['first_line'][:200]}" if e else ""), flush=True)  # fmt: skip
    os._exit(0)  # the engine may leave threads or a process group behind


if __name__ == "__main__":
    main()
