"""The engine scenarios: what each runs (read by scenario.py on the device,
driver.py for scheduling, ci/gpu/summarize.py for the tables), and CALLS,
the jobs of each call of a rerun of the kept measurements.

A scenario is an engine configuration plus a workload. Every engine runs a
dummy-weight model from ./models (load_format="dummy", skip_tokenizer_init,
prompts as token ids). Scheduler dimensions the fixes claim to cover:

  chunked prefill   on: max_num_batched_tokens 4096 (vllm#41726's setting)
                    off: max_num_batched_tokens = max_model_len
  prefix caching    on: a prefix-cache hit followed by a long uncached tail
                    (request A = ctx tokens, then A + 3497 new tokens)
  spec decoding     ngram, 3 speculative tokens (vllm#40807's trigger: full
                    CUDA graphs of uniform q_len = 4 batches)

Scenario names:
  m1..m6   dense Qwen3 tiny, turboquant_4bit_nc, CUDA graphs (defaults):
           m1 chunked+prefix (vllm#41726's configuration), m2 prefix only,
           m3 chunked only, m4 chunked+prefix+spec (vllm#40807's), m5 spec
           only, m6 prefix+spec
  h0, h1, h4   the Qwen3.5-style hybrid: engine start only (the gate), as m1,
           as m4
  e_*      the same as a graph scenario, enforce_eager=True (output equality)
  k_*      turboquant_k8v4 variants; a_* kv_cache_dtype="auto" variants
  s_*      decode throughput (exclusive GPU): s_graph (CUDA graphs),
           s_none (cudagraph_mode NONE, vllm#40807's workaround), s_eager
           (enforce_eager), with ngram spec decoding s_spec_graph / s_spec_none
  cont_bench  tq_continuation_bench.py's shapes on the release's real
              flash-attn (exclusive GPU)
  pfx, sd_*, sdx_*  silent wrong outputs (below)
"""

from __future__ import annotations

import copy
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = {
    "dense": HERE / "models" / "qwen3_dense_tiny",
    "hybrid": HERE / "models" / "qwen35_hybrid_tiny",
}
VOCAB_MAX = 4000  # token ids used in prompts: [10, VOCAB_MAX)
MAX_MODEL_LEN = 36864  # 28672 cached + 3497 tail + decode room
CHUNK = 4096  # max_num_batched_tokens with chunked prefill (vllm#41726)
TAIL = 3497  # the uncached tail of vllm#41726 (cached 4096 + q 3497)
LONG_CTX = (4096, 12288, 28672)  # cached context of the continuation requests
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
KV_BYTES = 2 << 30  # kv_cache_memory_bytes where the memory profile is not the point
# With kv_cache_memory_bytes, vLLM still checks at worker start that
# total x gpu_memory_utilization is free (v1/worker/utils.py request_memory):
# the default 0.9 would refuse every job but the first one running at a time.
KV_GMU = 0.06
GMU = 0.3  # gpu_memory_utilization where it is (spec + graphs: vllm#40807)

# Workloads (scenario.py implements them):
#   std   8 short prompts (greedy, 32 tokens, top-5 logprobs), then the long
#         continuation requests of LONG_CTX, measuring GPU memory after each
#   speed decode throughput at short prompts, batch 1 and 32
#   none  start the engine only
BASE = {
    "model": "dense",
    "kv": "turboquant_4bit_nc",
    "chunked": True,
    "prefix": True,
    "spec": False,
    "graphs": "default",  # default | eager | none
    "workload": "std",
    "mp": 0,  # VLLM_ENABLE_V1_MULTIPROCESSING (0: engine core in-process)
    "timeout": 240,
    "exclusive": False,
    "mem": "kv",  # kv: kv_cache_memory_bytes=KV_BYTES; gmu: gpu_memory_utilization=GMU
}


def _s(**kw) -> dict:
    d = copy.deepcopy(BASE)
    d.update(kw)
    return d


SCENARIOS: dict[str, dict] = {
    "m1": _s(doc="chunked+prefix, no spec (vllm#41726 config)"),
    "m2": _s(chunked=False, doc="prefix only: prefix hit + 3497-token tail"),
    "m3": _s(prefix=False, doc="chunked only"),
    "m4": _s(spec=True, mem="gmu", exclusive=True, doc="chunked+prefix+ngram spec (vllm#40807 config)"),
    "m5": _s(chunked=False, prefix=False, spec=True, doc="spec only"),
    "m6": _s(chunked=False, spec=True, doc="prefix+spec, no chunking"),
    "h1": _s(model="hybrid", doc="hybrid, chunked+prefix"),
    "h4": _s(model="hybrid", spec=True, doc="hybrid, chunked+prefix+spec"),
    "h0": _s(model="hybrid", workload="none", doc="hybrid, engine start only (the gate)"),
    # output equality: graphs (m1/h1/k_m1/k_h1) vs eager
    "e_m1": _s(graphs="eager", doc="m1 eager"),
    "e_h1": _s(model="hybrid", graphs="eager", doc="h1 eager"),
    "k_m1": _s(kv="turboquant_k8v4", doc="m1 with turboquant_k8v4"),
    "k_h1": _s(model="hybrid", kv="turboquant_k8v4", doc="h1 with k8v4"),
    "ke_m1": _s(kv="turboquant_k8v4", graphs="eager", doc="k_m1 eager"),
    "ke_h1": _s(model="hybrid", kv="turboquant_k8v4", graphs="eager", doc="k_h1 eager"),
    # TurboQuant vs auto (bf16 KV) on the same dummy model
    "a_m1": _s(kv="auto", doc="m1 with kv_cache_dtype auto"),
    "a_h1": _s(model="hybrid", kv="auto", doc="h1 with kv_cache_dtype auto"),
    # decode throughput, exclusive
    "s_graph": _s(workload="speed", prefix=False, mp=1, exclusive=True, timeout=200,
                  doc="throughput, CUDA graphs"),
    "s_none": _s(workload="speed", prefix=False, graphs="none", mp=1, exclusive=True,
                 timeout=200, doc="throughput, cudagraph_mode NONE (workaround)"),
    "s_eager": _s(workload="speed", prefix=False, graphs="eager", mp=1, exclusive=True,
                  timeout=200, doc="throughput, enforce_eager (workaround)"),
    "s_spec_graph": _s(workload="speed", prefix=False, spec=True, mp=1, exclusive=True,
                       timeout=200, doc="throughput, ngram spec, CUDA graphs"),
    "s_spec_none": _s(workload="speed", prefix=False, spec=True, graphs="none", mp=1,
                      exclusive=True, timeout=200,
                      doc="throughput, ngram spec, cudagraph_mode NONE"),
    "cont_bench": {"kind": "cont_bench", "timeout": 240, "exclusive": True,
                   "doc": "continuation prefill kernel benchmark, real FA2"},
}

# --------------------------------------------------------------------------
# Silent wrong outputs (exact oracles): a prefix-cache hit batched with a
# longer fresh prompt (vllm#46460; tq/0004, tq-v0.33/0003), and speculative
# decoding under full CUDA graphs / async scheduling (#41434's capture and
# host lengths; tq-v0.33/0002; vllm#52475, #53180).
#   pfx, pfx_auto   workload "prefix_batch" (PFX): H = P + tail with P cached,
#                   run alone and in one step with a fresh prompt F longer
#                   than H; prompt logprobs of H's tail + greedy tokens
#   sd_*            workload "spec_eq" (spec_prompts, SPEC_TOKENS greedy
#                   tokens each, batch 1, then all at once): with ngram
#                   speculation vs without (sd_ref), same tree
#   sdx_*           the same as an sd_* configuration, alone on the GPU (tok/s)
# sd_/sdx_ names: f/p/e = FULL_AND_PIECEWISE (default) / PIECEWISE / eager;
# a/s = async scheduling on (ngram_gpu: plain ngram cannot run async) / off
# (plain ngram). All run on the V1 model runner (v0.26.0 has no ngram on V2),
# where v0.26.0 needs the #50709 port (variant kvfix) to start with TurboQuant.
# --------------------------------------------------------------------------
EQ_LEN = 4096  # max_model_len of the pfx / sd scenarios
EQ_KV = 1 << 30  # their kv_cache_memory_bytes
PFX = {"prefix": 1024, "tail": 256, "fresh": 1536, "trials": 3, "max_tokens": 16}
SPEC_TOKENS = 256
SPEC_EQ = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def _eq(**kw) -> dict:
    d = _s(max_model_len=EQ_LEN, kv_bytes=EQ_KV, max_num_seqs=8, timeout=400, disable_log_stats=False)
    d.update(kw)
    return d


def _sd(graphs: str, asyn: bool, **kw) -> dict:
    return _eq(workload="spec_eq", spec=True, spec_method="ngram_gpu" if asyn else "ngram",
               async_scheduling=asyn, graphs=graphs, runner="v1", **kw)


SCENARIOS.update({
    "pfx": _eq(workload="prefix_batch", doc="prefix hit batched with a longer fresh prompt (vllm#46460)"),
    "pfx_auto": _eq(workload="prefix_batch", kv="auto", doc="pfx with kv_cache_dtype auto (reference)"),
    "sd_ref": _eq(workload="spec_eq", runner="v1", doc="no speculation (the reference), V1 runner"),
    "sd_fa": _sd("default", True, doc="ngram_gpu, FULL_AND_PIECEWISE, async"),
    "sd_fs": _sd("default", False, doc="ngram, FULL_AND_PIECEWISE, no async"),
    "sd_pa": _sd("piecewise", True, doc="ngram_gpu, PIECEWISE, async"),
    "sdx_fa": _sd("default", True, exclusive=True, timeout=240, doc="sd_fa alone on the GPU (tok/s)"),
    "sdx_ps": _sd("piecewise", False, exclusive=True, timeout=240,
                  doc="ngram, PIECEWISE, no async (the workaround) alone (tok/s)"),
    "sdx_es": _sd("eager", False, exclusive=True, timeout=240,
                  doc="ngram, enforce_eager, no async (the workaround) alone (tok/s)"),
})
for _n, _d in SCENARIOS.items():
    _d.setdefault("kind", "engine")


def engine_kwargs(name: str, *, model_dir: Path | None = None) -> dict:
    """EngineArgs / LLM(**kwargs) of an engine scenario."""
    s = SCENARIOS[name]
    assert s["kind"] == "engine", name
    max_len = s.get("max_model_len", MAX_MODEL_LEN)
    kw: dict = dict(
        model=str(model_dir or MODELS[s["model"]]),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=max_len,
        max_num_seqs=s.get("max_num_seqs", 32 if s["workload"] == "speed" else 16),
        kv_cache_dtype=s["kv"],
        enable_prefix_caching=s["prefix"],
        enable_chunked_prefill=s["chunked"],
        max_num_batched_tokens=CHUNK if s["chunked"] else max_len,
    )
    if s["model"] == "hybrid":
        kw["language_model_only"] = True
    if s["spec"]:
        kw["speculative_config"] = dict(SPEC)
        if "spec_method" in s:
            kw["speculative_config"] = {"method": s["spec_method"], **SPEC_EQ}
    for k in ("async_scheduling", "disable_log_stats"):
        if k in s:
            kw[k] = s[k]
    if s["graphs"] == "eager":
        kw["enforce_eager"] = True
    elif s["graphs"] in ("none", "piecewise"):
        kw["compilation_config"] = {"cudagraph_mode": s["graphs"].upper()}
    # vllm#40807 fails in the CUDA-graph memory profile, which only the
    # gpu_memory_utilization path runs (m4, as the issue ran it; with a fixed
    # KV budget the same error comes from capture_model instead); elsewhere a
    # fixed KV budget keeps concurrent jobs out of each other's memory profile.
    if s["mem"] == "gmu" or s["workload"] == "speed":
        kw["gpu_memory_utilization"] = GMU
    else:
        kw["kv_cache_memory_bytes"] = s.get("kv_bytes", KV_BYTES)
        kw["gpu_memory_utilization"] = KV_GMU
    return kw


def engine_env(name: str) -> dict[str, str]:
    """Environment of an engine scenario's process (set before vLLM is
    imported): the V1 model runner where the scenario asks for it."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if SCENARIOS[name].get("runner") == "v1" else {}


def short_prompts() -> list[list[int]]:
    """8 prompts: 4 random (48-96 tokens), 4 repetitive (n-gram friendly)."""
    import random

    r = random.Random(1234)
    out = []
    for i in range(4):
        n = 48 + 16 * i
        out.append([r.randrange(10, VOCAB_MAX) for _ in range(n)])
    for i in range(4):
        block = [r.randrange(10, VOCAB_MAX) for _ in range(8 + 4 * i)]
        out.append((block * 16)[: 64 + 8 * i])
    return out


def random_tokens(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(10, VOCAB_MAX) for _ in range(n)]


def pfx_trials() -> list[dict]:
    """Prefix hit batched with a fresh prompt (PFX): per trial a cached
    prefix P, H = P + tail, and a fresh prompt F longer than H."""
    out = []
    for i in range(PFX["trials"]):
        out.append({"seed": 3000 + i, "P": random_tokens(PFX["prefix"], 3000 + i),
                    "tail": random_tokens(PFX["tail"], 3100 + i),
                    "F": random_tokens(PFX["fresh"], 3200 + i)})
    return out


def spec_prompts() -> list[list[int]]:
    """4 repetitive prompts (a random block repeated): ngram drafts fire on
    them from the first step, and greedy output of the dummy model repeats
    tokens (measured: runs of one token), which keeps them firing."""
    out = []
    for i, (block, n) in enumerate(((8, 96), (12, 128), (16, 160), (24, 192))):
        b = random_tokens(block, 4000 + i)
        out.append((b * (n // block + 1))[:n])
    return out


def long_requests(prefix: bool) -> list[dict]:
    """The continuation requests of the std workload, in order. With prefix
    caching: A = ctx tokens, then B = A + TAIL (a prefix hit of ctx tokens and
    a TAIL-token continuation). Without: one prompt of ctx + TAIL tokens
    (with chunked prefill its later chunks are continuations)."""
    reqs = []
    for j, ctx in enumerate(LONG_CTX):
        base = random_tokens(ctx, 1000 + j)
        tail = random_tokens(TAIL, 2000 + j)
        if prefix:
            reqs.append({"label": f"prefix{ctx}", "ctx": ctx, "prompt": base, "measure": False})
            reqs.append({"label": f"hit{ctx}+{TAIL}", "ctx": ctx, "prompt": base + tail,
                         "measure": True})
        else:
            reqs.append({"label": f"long{ctx}+{TAIL}", "ctx": ctx, "prompt": base + tail,
                         "measure": True})
    return reqs


# --------------------------------------------------------------------------
# The calls of a rerun (run.sh's engine part: CALL=NAME), each
# (jobs at once, budget s, jobs RELEASE:VARIANT:SCENARIO in order of value:
# the deadline cuts the tail). Staged by `stage.py releases v0.20.2,v0.21.0,
# v0.26.0` with the overlays v0.20.2:patched (the tq wheel), v0.26.0:kvfix
# and v0.26.0:patched (engine/overlays.sh). Results of 2026-11-23 (calls
# c1-c9) and 2026-11-25 (p1-p4): ci/gpu/results/engine-2026-11-2{3,5}/.
# --------------------------------------------------------------------------


def jobs(*groups: str) -> list[str]:
    """"REL:VARIANT:s1,s2,..." groups as RELEASE:VARIANT:SCENARIO jobs."""
    out = []
    for g in groups:
        rel, var, names = g.split(":")
        out += [f"{rel}:{var}:{n}" for n in names.split(",")]
    return out


U0, P0, U1 = "v0.20.2:unpatched", "v0.20.2:patched", "v0.21.0:unpatched"
CALLS: dict[str, tuple[int, int, list[str]]] = {
    # the crashes of the release wheels, the patched wheel serving the same
    # scenarios, output equality and TurboQuant vs auto (calls c3, c6)
    "crashes": (6, 420, jobs(
        f"{U0}:m4,h0,m1", f"{U1}:m1,h1", f"{P0}:m4,h1,m1,e_m1,e_h1,a_m1,a_h1",
        f"{U0}:m2", f"{P0}:m2", f"{U0}:m3", f"{P0}:m3", f"{U0}:m5", f"{P0}:m5,h4",
        f"{U1}:m2,m4,m5,h4", f"{U0}:m6", f"{P0}:m6")),
    # alone on the GPU: throughput against the workarounds, the continuation
    # kernel on the wheels' FA2 ((c), (b), (a)); the k8v4 pairs (c4, c8)
    "speed": (6, 420, jobs(
        f"{P0}:s_graph", f"{U0}:s_none,s_eager", f"{P0}:cont_bench",
        f"{U1}:cont_bench", f"{P0}:k_m1,ke_m1,k_h1,ke_h1", f"{U0}:cont_bench",
        f"{P0}:s_spec_graph", f"{U0}:s_spec_none")),
    # v0.26.0 as released (c5; its patched column of 2026-11-23 was a hand
    # port that is not kept)
    "v026": (6, 300, jobs("v0.26.0:unpatched:m2,m1,m4,h1,h4,m5")),
    # silent wrong outputs on v0.20.2: the prefix hit (vllm#46460), spec
    # decoding under full graphs (p3)
    "pfx": (6, 330, jobs(f"{U0}:pfx", f"{P0}:pfx", f"{U0}:pfx_auto", f"{P0}:sd_ref,sd_fs")),
    # the same on v0.26.0: the parallel ones first, then the timed ones
    # alone (p4)
    "spec": (8, 560, jobs(
        "v0.26.0:unpatched:sd_fa", "v0.26.0:kvfix:sd_ref,sd_fa,sd_fs,sd_pa",
        "v0.26.0:patched:sd_ref,sd_fs", "v0.26.0:unpatched:pfx",
        "v0.26.0:patched:pfx", "v0.26.0:unpatched:pfx_auto",
        "v0.26.0:patched:sdx_fa", "v0.26.0:kvfix:sdx_ps,sdx_es")),
}
