"""Which import-time dependencies does a vLLM release tree need on the GPU
machine? Run HERE (CPU), once per release tree, before staging:

    PYTHONPATH=/tmp/engdeps .venv/bin/python ci/gpu/engine/deps_probe.py \
        --tree /work/stage/trees/v0.20.2 [--json out.json]

It imports the engine modules the scenarios use (LLM entry point, engine
core, executors, GPU worker and model runner, the two model families,
TurboQuant / flash-attn / GDN backends, n-gram proposer, sampler, dummy
loader, structured-output backends, ...) from the tree, with vLLM's CPU
platform installed (vllm.platforms.cuda imports the compiled vllm._C, which
cannot load here), then maps every imported top-level module to its
distribution and subtracts what the device image already has
(device_packages.txt, from the device library's KINDS.md). What is left must
travel as cp312 wheels (build_stage.py's DEPS).

Modules imported lazily inside functions are not seen here; the device-side
smoke check (scenario.py --scenario import) imports the same list plus the
CUDA platform, and any ModuleNotFoundError on the device names the rest.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Engine modules the scenarios reach (the union over releases; a module a
# release lacks is reported "absent", not as an error).
MODULES = [
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.input_processor",
    "vllm.v1.engine.processor",
    "vllm.v1.engine.output_processor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.abstract",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.workspace",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.spec_decode.ngram_proposer",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.structured_output",
    "vllm.v1.structured_output.backend_xgrammar",
    "vllm.v1.structured_output.backend_guidance",
    "vllm.v1.attention.backends.turboquant_attn",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.fa_utils",
    "vllm.v1.attention.ops.merge_attn_states",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.models.qwen3_5",
    "vllm.model_executor.layers.quantization.turboquant.config",
    "vllm.model_executor.layers.mamba.gdn_linear_attn",
    "vllm.compilation.backends",
    "vllm.compilation.cuda_graph",
    "vllm.compilation.piecewise_backend",
    "vllm.distributed.parallel_state",
    "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.multimodal",
    "vllm.multimodal.registry",
    "vllm.transformers_utils.config",
    "vllm.device_allocator.cumem",
    "vllm.utils.torch_utils",
]


def device_packages() -> set[str]:
    names = (HERE / "device_packages.txt").read_text().split()
    return {n.lower().replace("_", "-") for n in names}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    tree = Path(a.tree).resolve()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, str(tree))
    before = set(sys.modules)
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    assert Path(vllm.__file__).resolve().is_relative_to(tree), vllm.__file__
    platforms._current_platform = CpuPlatform()
    res: dict = {"tree": str(tree), "modules": {}, "missing": {}}
    for m in MODULES:
        try:
            importlib.import_module(m)
            res["modules"][m] = "ok"
        except ModuleNotFoundError as e:
            if e.name and (e.name == m or m.startswith(e.name + ".")):
                res["modules"][m] = "absent"
            else:
                res["modules"][m] = f"ModuleNotFoundError: {e.name}"
                res["missing"].setdefault(e.name, []).append(m)
        except Exception as e:  # noqa: BLE001
            res["modules"][m] = f"{type(e).__name__}: {str(e)[:200]}"
            res.setdefault("tracebacks", {})[m] = traceback.format_exc()[-1500:]
    top = sorted({k.split(".")[0] for k in set(sys.modules) - before})
    p2d = md.packages_distributions()
    have = device_packages()
    dists: dict[str, str] = {}
    for t in top:
        for d in p2d.get(t, []):
            key = d.lower().replace("_", "-")
            if key in have or key == "vllm":
                continue
            try:
                dists[d] = md.version(d)
            except md.PackageNotFoundError:
                dists[d] = "?"
    res["needed_distributions"] = dict(sorted(dists.items(), key=lambda x: x[0].lower()))
    res["stdlib_or_unmapped"] = [t for t in top if t not in p2d]
    print(json.dumps({k: v for k, v in res.items() if k != "tracebacks"}, indent=1))
    for m, tb in res.get("tracebacks", {}).items():
        print(f"--- {m}\n{tb}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
