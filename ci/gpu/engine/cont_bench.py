"""Continuation-prefill benchmark on a release tree WITH its compiled
extensions (scenario "cont_bench" of scenario.py; device side).

Runs ci/gpu/tq_continuation_bench.py unchanged (Hq=16, Hk=4, D=256, bf16,
block 16, turboquant_4bit_nc and k8v4, cached 4K/32K/128K, q_len 512/4096,
max_num_batched_tokens 8192; reserved bytes at max_model_len 128K and 1M;
floor from the measured copy bandwidth and bf16 matmul rate) with three
changes made here, from outside:

- the platform is vLLM's CudaPlatform (the tree has vllm._C /
  _C_stable_libtorch and vllm_flash_attn), not the CpuPlatform stand-in of
  the source-tree runs;
- attention mode "real": the tree's own flash_attn_varlen_func (the wheel's
  vllm_flash_attn) and merge_attn_states stay in place; no stand-in;
- the config sets attention_config.flash_attn_version=2, as EngineArgs does
  for every turboquant_* dtype on these releases.

Variant: a = v0.20.x unpatched (per-layer buffers), b = a later unpatched
release (full dequant into the shared workspace, pre-grown to v0.24.0's
reservation and locked, as the bench does), c = patched (tq/0001's tiles).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ci/gpu


def name_of(f) -> str:
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', '?')}"


def on_the_release(tqlib, res: dict) -> None:
    """tqlib's tree, config and attention mode as the release runs them."""
    use_tree, make_config, set_mode = tqlib.use_tree, tqlib.make_config, tqlib.set_attention_mode

    def use_release(tree):
        import vllm.platforms as platforms
        from vllm.platforms.cuda import CudaPlatform

        env = use_tree(tree)
        if not isinstance(platforms._current_platform, CudaPlatform):
            raise RuntimeError(f"platform {type(platforms._current_platform).__name__}, "
                               "not CudaPlatform (compiled extensions missing?)")  # fmt: skip
        return env

    def fa2_config(env, **kw):
        cfg = make_config(env, **kw)
        cfg.attention_config.flash_attn_version = 2
        return cfg

    def real_mode(env, mode):
        if mode != "real":
            return set_mode(env, mode)
        if not env.tqa._HAS_FLASH_ATTN:
            raise RuntimeError("the tree's _HAS_FLASH_ATTN is False: vllm_flash_attn did not load")
        res["real_flash_attn_varlen_func"] = name_of(getattr(env.tqa, "flash_attn_varlen_func", None))
        merge = getattr(env.tqa, "merge_attn_states", None)
        res["real_merge_attn_states"] = name_of(merge) if merge else "not used by this tree"

    tqlib.use_tree, tqlib.make_config, tqlib.set_attention_mode = use_release, fa2_config, real_mode


def run(res: dict, release: str, variant: str, tree: str, json_path: str) -> None:
    import tq_continuation_bench as bench
    import tqlib

    letter = "c" if variant != "unpatched" else "a" if release.startswith("v0.20.") else "b"
    res["bench_variant"] = letter
    on_the_release(tqlib, res)
    out = Path(json_path).with_suffix(".bench.json")
    argv, sys.argv = sys.argv, ["tq_continuation_bench.py", "--tree", tree, "--variant", letter,
                                "--out", str(out), "--modes", "real", "--budget", "0.3"]  # fmt: skip
    t = time.time()
    try:
        res["bench_rc"] = bench.main()
    finally:
        sys.argv = argv
    res["bench_wall_s"] = round(time.time() - t, 1)
    if not out.exists():
        res["outcome"] = "failed"
        return
    res["bench"] = json.loads(out.read_text())
    errs = res["bench"].get("errors") or []
    res["outcome"] = "partial" if errs else "ok"
    if errs:
        res["error"] = {"type": "BenchRowErrors", "first_line": f"{len(errs)} rows failed: {errs[0]['key']}"}
