"""ENG_FAKE=1: synthetic results of scenario.py in the real format, for dry
runs of driver.py and summarize.py on a machine without a GPU (never on the
device). Outcomes follow the predictions (ci/gpu/NOTES.md): the release
wheels fail or answer wrong where a fix is missing, patched trees serve.
"""

from __future__ import annotations

import os
import random
import time
import zlib

import scenarios as S

HYBRID_GATE = (
    "TurboQuant KV cache is not supported for hybrid (attention + Mamba) models. "
    "Boundary layer protection requires uniform attention layers."
)
CAPTURE_COPY = (
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless "
    "the CPU tensor is pinned"
)
WORKSPACE_LOCKED = (
    "Workspace is locked but allocation from "
    "'turboquant_attn.py:747:_continuation_prefill' requires 16.00 MB, current "
    "size is 1.02 MB. Workspace growth is not allowed after locking."
)
KV_DTYPE_AUTO = (
    "Unknown TurboQuant cache dtype: 'auto'. Valid presets: turboquant_k8v4, ..."
)


def fake(res: dict, name: str, release: str, variant: str) -> None:
    """One scenario's synthetic result."""
    s = S.SCENARIOS[name]
    time.sleep(float(os.environ.get("ENG_FAKE_SLEEP", "1")))
    res["fake"] = True
    res["gpu"] = "FAKE (dry run)"
    if s["kind"] == "import":
        res["outcome"] = "ok"
        return
    if s["kind"] == "cont_bench":
        fake_bench(res, release, variant)
        return
    res["engine_kwargs"] = S.engine_kwargs(name)
    res["vllm"] = release.lstrip("v") + ("+tq.fake" if variant != "unpatched" else "")
    error = startup_error(s, release, variant)
    if error:
        res.update(outcome="init_failed", phase="init", error=error)
    elif s["workload"] in ("prefix_batch", "spec_eq"):
        fake_eq(res, name, release, variant)
    elif s["workload"] == "speed":
        fake_speed(res, s)
    else:
        fake_std(res, name, release, variant)


def startup_error(s: dict, release: str, variant: str) -> dict | None:
    """v0.20.2's engine start-up failures (hybrid gate, vllm#40807)."""
    if variant != "unpatched" or release != "v0.20.2":
        return None
    if s["model"] == "hybrid":
        return {"type": "NotImplementedError", "first_line": HYBRID_GATE, "chain": []}
    if s["spec"] and s["graphs"] == "default":
        return {"type": "RuntimeError", "first_line": CAPTURE_COPY, "chain": []}
    return None


def fake_bench(res: dict, release: str, variant: str) -> None:
    """cont_bench: (a) slowest, (c) fastest, against a made-up floor."""
    import cont_bench

    v = cont_bench.variant_letter(release, variant)
    res["bench_variant"] = v
    res["real_flash_attn_varlen_func"] = (
        "vllm.vllm_flash_attn.flash_attn_interface.flash_attn_varlen_func"
    )
    runs = []
    for preset in ("turboquant_4bit_nc", "turboquant_k8v4"):
        for cached in (4096, 32768, 131072):
            for q in (512, 4096):
                fl = 4 * q * cached * 16 * 256 / 7.5e14 * 1e3
                t = fl * {"a": 3.0, "b": 2.6, "c": 1.6}[v]
                runs.append(
                    {
                        "preset": preset,
                        "mode": "real",
                        "cached": cached,
                        "q": q,
                        "floor": {"floor_ms": fl},
                        "time": {"median_ms": t},
                        "peak_extra_bytes": {"a": 512, "b": 300, "c": 20}[v] << 20,
                    }
                )
    workspace = {"a": 0, "b": 512 << 20, "c": 32 << 20}[v]
    res["bench"] = {
        "runs": runs,
        "reserved": {"131072": {"workspace_bytes": workspace}},
        "device": {"device": "FAKE"},
        "errors": [],
    }
    res["outcome"] = "ok"


def fake_speed(res: dict, s: dict) -> None:
    """Throughput: CUDA graphs faster than the workarounds."""
    base = {"default": 1.0, "none": 0.45, "eager": 0.35}[s["graphs"]]
    res["speed"] = {
        f"bs{b}": {
            "best_tok_per_s": round(base * (400 if b == 1 else 6000), 1),
            "reps": [],
        }
        for b in (1, 32)
    }
    res["outcome"] = "ok"


def fake_std(res: dict, name: str, release: str, variant: str) -> None:
    """Short prompts, then the continuation requests: v0.21.0-v0.23.0
    unpatched fail at the first measured one (workspace locked), v0.20.2
    unpatched grows its per-layer buffers."""
    s = S.SCENARIOS[name]
    unp = variant == "unpatched"
    r = random.Random(7)
    short = []
    for _ in S.short_prompts():
        toks = [r.randrange(10, 4000) for _ in range(32)]
        off = 0.02 if s["kv"] == "auto" else 0.0
        lps = [{str(t): round(-1.0 - off - 0.001 * j, 5)} for j, t in enumerate(toks)]
        short.append({"token_ids": toks, "logprobs": lps})
    res["short"] = short
    res["long"] = []
    locks = unp and release in ("v0.21.0", "v0.22.0", "v0.23.0")
    grows = unp and release == "v0.20.2" and S.needs_continuation(name)
    for req in S.long_requests(s["prefix"]):
        row = {"label": req["label"], "ctx": req["ctx"]}
        row["prompt_len"] = len(req["prompt"])
        res["long"].append(row)
        if locks and S.needs_continuation(name) and req["measure"]:
            row["failed"] = True
            error = {"type": "AssertionError", "first_line": WORKSPACE_LOCKED}
            res.update(outcome="run_failed", phase="long", error=error | {"chain": []})
            return
        if req["measure"]:
            grow = (req["ctx"] * 4096 * 4) if grows else 0
            workspace = (151 << 20) if release >= "v0.24" else 1 << 20
            row["mem"] = {
                "allocated": (900 << 20) + grow,
                "tq_layer_tensor_bytes": grow,
                "workspace_bytes": (16 << 20) if not unp else workspace,
            }
            row["num_cached_tokens"] = req["ctx"] if s["prefix"] else 0
    res["outcome"] = "ok"


def fake_output(s: dict, seed: int, bad: bool, n: int) -> dict:
    """Greedy tokens and logprobs of one prompt; `bad`: wrong from token 3."""
    q = random.Random(seed)
    toks = [q.randrange(10, 4000) for _ in range(n)]
    lp = [round(-6.2 - q.random() * 0.2, 5) for _ in range(n)]
    if bad:
        toks = toks[:3] + [t + 1 for t in toks[3:]]
        lp = [x - 0.3 for x in lp]
    noise = 0.0 if s["kv"] != "auto" else 0.01
    return {
        "token_ids": toks,
        "logprobs": [{str(t): round(v + noise, 5)} for t, v in zip(toks, lp)],
        "num_cached_tokens": 0,
    }


def fake_eq(res: dict, name: str, release: str, variant: str) -> None:
    """The pfx / sd workloads: wrong where the fix is missing."""
    s = S.SCENARIOS[name]
    fixed = variant == "patched"
    if release == "v0.26.0" and variant == "unpatched" and s.get("runner") == "v1":
        error = {"type": "ValueError", "chain": [], "first_line": KV_DTYPE_AUTO}
        res.update(outcome="init_failed", phase="init", error=error)
        return
    r = random.Random(zlib.crc32(f"{name}/{release}/{variant}".encode()))
    res["weights_digest"] = "fake0000"
    if s["workload"] == "prefix_batch":
        fake_pfx(res, s, r, bad=not fixed and s["kv"] != "auto")
    else:
        workaround = s["graphs"] != "default" and not s.get("async_scheduling")
        fake_spec(res, s, bad=s["spec"] and not fixed and not workaround)
    res["outcome"] = "ok"


def fake_pfx(res: dict, s: dict, r: random.Random, bad: bool) -> None:
    """H batched with a fresh prompt: wrong tokens and tail logprobs if bad."""
    res["trials"] = []
    n = S.PFX["max_tokens"]
    for t in S.pfx_trials():
        a, b = fake_output(s, t["seed"], False, n), fake_output(s, t["seed"], bad, n)
        pl = [round(-8.3 + r.random() * 0.1, 5) for _ in range(S.PFX["tail"] - 1)]
        a["prompt_lp"] = pl
        b["prompt_lp"] = [x - (0.2 if bad else 0.0) for x in pl]
        a["num_cached_tokens"] = b["num_cached_tokens"] = S.PFX["prefix"]
        res["trials"].append(
            {
                "seed": t["seed"],
                "alone": a,
                "batched": b,
                "fresh": fake_output(s, 1, False, 4),
                "reset": [True, True],
            }
        )


def fake_spec(res: dict, s: dict, bad: bool) -> None:
    """Speculative decoding: wrong tokens if bad; counters and tok/s."""
    secs = 0.5 if s["graphs"] == "default" else 1.5
    res["spec_bs1"] = [
        {**fake_output(s, i, bad, S.SPEC_TOKENS), "s": secs} for i in range(4)
    ]
    res["spec_batch"] = {
        "s": 0.8,
        "outputs": [fake_output(s, i, bad, S.SPEC_TOKENS) for i in range(4)],
    }
    c = {
        "vllm:spec_decode_num_draft_tokens": 600.0,
        "vllm:spec_decode_num_accepted_tokens": 510.0,
    }
    res["spec_counters"] = {
        "start": {k: 0.0 for k in c},
        "bs1": c,
        "batch": {k: 2 * v for k, v in c.items()},
    }
    res["eq_speed"] = {
        "bs1_tok_per_s": round(1024 / sum(x["s"] for x in res["spec_bs1"]), 1),
        "bs4_tok_per_s": round(1024 / 0.8, 1),
    }
