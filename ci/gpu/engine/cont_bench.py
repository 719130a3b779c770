"""Continuation-prefill benchmark on a release tree WITH its compiled
extensions (scenario "cont_bench" of scenario.py; device side).

Reuses ci/gpu/tq_continuation_bench.py unchanged (shapes: Hq=16, Hk=4,
D=256, bf16, block 16, turboquant_4bit_nc and k8v4, cached 4K/32K/128K,
q_len 512/4096, max_num_batched_tokens 8192; reserved bytes at
max_model_len 128K and 1M; floor from measured copy bandwidth and bf16
matmul rate) with three changes made here, from outside:

- the platform is vLLM's CudaPlatform (the tree has vllm._C /
  _C_stable_libtorch and vllm_flash_attn), not the CpuPlatform stand-in the
  source-tree runs had to use;
- attention mode "real": the tree's own flash_attn_varlen_func (the wheel's
  vllm_flash_attn) and its own merge_attn_states (the compiled CUDA op where
  the tree dispatches to it) stay in place; no stand-in;
- the config passed to the impls sets attention_config.flash_attn_version=2,
  as EngineArgs does for every turboquant_* dtype on these releases.

Variant: a = v0.20.x unpatched (per-layer buffers), b = a later unpatched
release (full dequant into the shared workspace, pre-grown to v0.24.0's
reservation and locked, as the bench does), c = patched (tq/0001's tiles).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parents[1]  # ci/gpu


def variant_letter(release: str, variant: str) -> str:
    if variant != "unpatched":
        return "c"
    return "a" if release.startswith("v0.20.") else "b"


def run(res: dict, release: str, variant: str, tree: str, json_path: str) -> None:
    sys.path.insert(0, str(GPU_DIR))
    import tqlib
    import tq_continuation_bench as bench

    letter = variant_letter(release, variant)
    res["bench_variant"] = letter
    orig_use_tree = tqlib.use_tree

    def use_tree(t):
        # tqlib.use_tree installs CudaPlatform where the tree has its compiled
        # extensions (vllm/_C*.so: _C or _C_stable_libtorch) and a GPU is
        # there; this run needs it
        import vllm.platforms as platforms
        from vllm.platforms.cuda import CudaPlatform

        env = orig_use_tree(t)
        if not isinstance(platforms._current_platform, CudaPlatform):
            raise RuntimeError(f"platform is {type(platforms._current_platform).__name__}, "
                               "expected CudaPlatform (compiled extensions missing?)")
        return env

    orig_make_config = tqlib.make_config

    def make_config(env, **kw):
        cfg = orig_make_config(env, **kw)
        cfg.attention_config.flash_attn_version = 2
        return cfg

    orig_mode = tqlib.set_attention_mode

    def set_attention_mode(env, mode):
        if mode != "real":
            return orig_mode(env, mode)
        tqa = env.tqa
        if not tqa._HAS_FLASH_ATTN:
            raise RuntimeError("the tree's _HAS_FLASH_ATTN is False: vllm_flash_attn did not load")
        fa = getattr(tqa, "flash_attn_varlen_func", None)
        res["real_flash_attn_varlen_func"] = f"{getattr(fa, '__module__', '?')}.{getattr(fa, '__name__', '?')}"
        m = getattr(tqa, "merge_attn_states", None)
        res["real_merge_attn_states"] = (
            f"{getattr(m, '__module__', '?')}.{getattr(m, '__name__', '?')}" if m else "not used by this tree"
        )

    tqlib.use_tree = use_tree
    tqlib.make_config = make_config
    tqlib.set_attention_mode = set_attention_mode
    out = Path(json_path).with_suffix(".bench.json")
    argv = sys.argv
    sys.argv = ["tq_continuation_bench.py", "--tree", tree, "--variant", letter, "--out", str(out),
                "--modes", "real", "--budget", "0.3"]
    t = time.time()
    try:
        rc = bench.main()
    finally:
        sys.argv = argv
    res["bench_wall_s"] = round(time.time() - t, 1)
    res["bench_rc"] = rc
    if out.exists():
        res["bench"] = json.loads(out.read_text())
        errs = res["bench"].get("errors") or []
        res["outcome"] = "ok" if not errs else "partial"
        if errs:
            res["error"] = {"type": "BenchRowErrors", "first_line": f"{len(errs)} rows failed: {errs[0]['key']}"}
    else:
        res["outcome"] = "failed"
