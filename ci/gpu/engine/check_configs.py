"""Build the engine configuration of every engine scenario, on CPU, with the
release trees' own code (run HERE before the campaign; catches argument and
config errors that would otherwise cost device time):

    PYTHONPATH=/tmp/engdeps .venv/bin/python ci/gpu/engine/check_configs.py \
        --tree /work/stage/trees/v0.20.2 --release v0.20.2 --variant unpatched \
        [--scenarios m1,m4,h1] [--json out.json]
    python3 ci/gpu/engine/check_configs.py --all   # every staged tree, one subprocess each

What runs: EngineArgs(**scenarios.engine_kwargs(name)).create_engine_config()
under a stand-in of vLLM's own CudaPlatform (the release's class, with the
device queries answered for one H100: capability 9.0, 80 GiB): its
check_and_update_config resolves the compilation / CUDA-graph settings as on
the device. Stubbed, and why:
  - vllm._C, vllm._C_stable_libtorch, vllm_flash_attn._vllm_fa2_C: empty
    modules (the compiled files cannot load against this machine's CPU
    torch); nothing in config creation calls a kernel;
  - the model-inspection subprocess runs in-process (as
    tests/patches/test_tq_hybrid.py does: it cannot import an uninstalled
    tree);
  - Qwen3_5ForConditionalGeneration resolves to Qwen3NextForCausalLM for
    the inspection: vLLM's qwen3_5 module imports Qwen3-VL image processors
    that need torchvision, which is not installed here (it is on the
    device). The Mamba-state methods are the same code (the test checks it).
Not covered here: model construction, the attention backend choice, KV
cache grouping / page sizes, CUDA-graph capture: the device runs those.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scenarios as S  # noqa: E402

STAGE = Path(os.environ.get("ENG_STAGE", "/work/stage"))


def install_fake_cuda():
    for m in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C", "vllm._qutlass_C",
              "vllm._moe_C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C"):
        sys.modules.setdefault(m, types.ModuleType(m))
    import torch

    class _StubOps(types.ModuleType):
        """torch.ops._C / _C_cache_ops stand-in: capability queries that some
        modules make at import time answer True; nothing else is called."""

        def __getattr__(self, name):
            if "support" in name:
                return lambda *a, **k: True
            raise AttributeError(name)

    for ns in ("_C", "_C_cache_ops", "_C_custom_ar", "_moe_C", "_vllm_fa2_C", "_vllm_fa3_C"):
        setattr(torch.ops, ns, _StubOps(ns))
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    from vllm.platforms.interface import DeviceCapability

    base = getattr(cuda, "CudaPlatform")

    class FakeH100(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * 2**30

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return "GPU-00000000-fake"

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def log_warnings(cls):
            pass

    platforms._current_platform = FakeH100()
    return FakeH100


def inspect_in_process():
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()
    registry.ModelRegistry.models["Qwen3_5ForConditionalGeneration"] = registry._LazyRegisteredModel(
        module_name="vllm.model_executor.models.qwen3_next", class_name="Qwen3NextForCausalLM")


def summarize(vc) -> dict:
    cc = vc.compilation_config
    out = {
        "cudagraph_mode": str(cc.cudagraph_mode),
        "compilation_mode": str(getattr(cc, "mode", getattr(cc, "level", None))),
        "capture_sizes": list(cc.cudagraph_capture_sizes or [])[:8] + (["..."] if len(cc.cudagraph_capture_sizes or []) > 8 else []),
        "max_capture_size": getattr(cc, "max_cudagraph_capture_size", None),
        "flash_attn_version": getattr(vc.attention_config, "flash_attn_version", None),
        "kv_cache_dtype": vc.cache_config.cache_dtype,
        "kv_skip_layers": getattr(vc.cache_config, "kv_cache_dtype_skip_layers", None),
        "block_size": vc.cache_config.block_size,
        "prefix_caching": vc.cache_config.enable_prefix_caching,
        "mamba_cache_mode": getattr(vc.cache_config, "mamba_cache_mode", None),
        "chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "async_scheduling": getattr(vc.scheduler_config, "async_scheduling", None),
        "spec": (vc.speculative_config.method if vc.speculative_config else None),
        "is_hybrid": vc.model_config.is_hybrid,
        "enforce_eager": vc.model_config.enforce_eager,
    }
    # The runner the engine takes (the property reads the environment; on CPU
    # it says False where V2 needs Triton, which is off without a GPU).
    out["v2_runner"] = getattr(vc, "use_v2_model_runner", "no V2 in this release")
    return out


def check_tree(tree: Path, release: str, variant: str, names: list[str]) -> dict:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/engcheck-cache")
    sys.path.insert(0, str(tree))
    import vllm

    assert Path(vllm.__file__).resolve().is_relative_to(tree.resolve()), vllm.__file__
    install_fake_cuda()
    inspect_in_process()
    from vllm.engine.arg_utils import EngineArgs

    res = {"release": release, "variant": variant, "tree": str(tree), "vllm": vllm.__version__, "scenarios": {}}
    saved = dict(os.environ)
    for n in names:
        kw = S.engine_kwargs(n)
        os.environ.update(S.engine_env(n))
        try:
            vc = EngineArgs(**kw).create_engine_config()
            res["scenarios"][n] = {"outcome": "ok", **summarize(vc)}
        except BaseException as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            res["scenarios"][n] = {"outcome": "config_failed", "type": type(e).__name__,
                                   "first_line": (msg[0] if msg else "")[:400],
                                   "traceback_tail": traceback.format_exc()[-1500:]}
        os.environ.clear()
        os.environ.update(saved)
    return res


def all_trees() -> list[tuple[Path, str, str]]:
    out = []
    for d in sorted((STAGE / "trees").iterdir()):
        if d.is_dir() and (d / "vllm" / "__init__.py").exists():
            name = d.name
            rel, _, var = name.partition("+")
            out.append((d, rel, var or "unpatched"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--release")
    ap.add_argument("--variant", default="unpatched")
    ap.add_argument("--scenarios", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    names = [n for n in (a.scenarios.split(",") if a.scenarios else S.SCENARIOS) if S.SCENARIOS[n]["kind"] == "engine"]
    if a.all:
        results = []
        for tree, rel, var in all_trees():
            out = Path(f"/tmp/engcheck-{tree.name}.json")
            cmd = [sys.executable, __file__, "--tree", str(tree), "--release", rel, "--variant", var,
                   "--json", str(out), "--scenarios", ",".join(names)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.exists():
                results.append(json.loads(out.read_text()))
            else:
                results.append({"release": rel, "variant": var, "error": p.stderr[-2000:]})
        print_table(results)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
        return 0
    res = check_tree(Path(a.tree), a.release, a.variant, names)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print_table([res])
    return 0


def print_table(results: list[dict]) -> None:
    print("| release | variant | scenario | outcome | cudagraph_mode | fa | chunked/mbt | prefix | spec | skip layers "
          "| async | V2 runner |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['release']} | {r['variant']} | * | ERROR {r['error'][-300:]!r} |")
            continue
        for n, s in r["scenarios"].items():
            if s["outcome"] != "ok":
                print(f"| {r['release']} | {r['variant']} | {n} | {s['type']}: {s['first_line'][:150]} | | | | | | |")
            else:
                print(f"| {r['release']} | {r['variant']} | {n} | ok | {s['cudagraph_mode']} | {s['flash_attn_version']} | "
                      f"{s['chunked_prefill']}/{s['max_num_batched_tokens']} | {s['prefix_caching']} | {s['spec']} | "
                      f"{s['kv_skip_layers']} | {s['async_scheduling']} | {s.get('v2_runner')} |")


if __name__ == "__main__":
    sys.exit(main())
