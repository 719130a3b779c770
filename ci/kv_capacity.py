#!/usr/bin/env python3
"""KV cache capacity of hybrid (attention + Mamba) models with TurboQuant, as
a vLLM tree's own planner plans it, on CPU.

For Jamba-v0.1's and Qwen3.5-9B's shapes (the configs of
tests/patches/test_tq_hybrid.py, nothing downloaded), bf16 and two
TurboQuant presets, without skip layers and with the first or the last
attention layer kept native (``--kv-cache-dtype-skip-layers``), each tree
plans the KV cache as a GPU worker and the engine core do (the tests'
``build_kv_cache_specs``: block size planned for the model's layers, each
layer's spec as the runner makes it, then the tree's grouping and KV cache
config for the budget). The tokens that fit are N x L for the largest L
such that N running requests of L tokens hold their blocks: cdiv(L, block
size) in each attention group, and in each Mamba group the blocks its spec
keeps per request (``max_memory_usage_bytes`` over the page). Each tree
runs in a process of its own; the table puts them side by side:

    .venv/bin/python ci/kv_capacity.py v0.33.0=/tmp/trees/patched_tq-v0.33_v0.33.0 \\
        patched=DIR [--budget-gib 4] [--seqs 8] [--json build/kv_capacity.json]

Columns per tree: tokens that fit; the bytes per token the TurboQuant and
the skip layer's pages hold (page over block size, padding included); the
Mamba page over the Mamba state it holds. "refused": the tree does not take
TurboQuant on a hybrid (v0.20.x without tq/0003).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "patches"))

MODELS = {"Jamba-v0.1": "jamba", "Qwen3.5-9B": "qwen3_5_9b"}
PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4")
SKIPS = ("none", "first", "last")


def scenarios() -> list[tuple[str, str, str]]:
    rows = []
    for model in MODELS:
        rows.append((model, "auto", "none"))
        rows += [(model, preset, skip) for preset in PRESETS for skip in SKIPS]
    return rows


def skipped_layers(model: str, skip: str) -> list[int]:
    """The model's first or last attention layer, or none."""
    import test_tq_hybrid as t

    _, attention = t.HYBRIDS[MODELS[model]]
    return {"none": [], "first": attention[:1], "last": attention[-1:]}[skip]


def measure(model: str, dtype: str, skipped: list[int], budget: int, seqs: int) -> dict:
    """One scenario on the tree this process imports."""
    import pytest
    import test_tq_hybrid as t
    import tqharness as h

    make_config, _ = t.HYBRIDS[MODELS[model]]
    with pytest.MonkeyPatch.context() as monkeypatch:
        t.use_engine_env(monkeypatch, Path(tempfile.mkdtemp(prefix="vllm-cache-")))
        t.stand_in_optional_modules(monkeypatch)
        try:
            vllm_config = t.engine_config(
                make_config(),
                Path(tempfile.mkdtemp(prefix="model-")),
                kv_cache_dtype=dtype,
                skip_layers=[str(i) for i in skipped],
            )
        except NotImplementedError as e:
            return {"error": "refused", "why": str(e)}
        specs, _ = t.build_kv_cache_specs(vllm_config, monkeypatch)
        plan = t.page_plan(specs, h.kv_cache_groups(vllm_config, specs))
        (kv_cache_config,) = h.kv_cache_configs(vllm_config, [specs], [budget])
        cache_config = vllm_config.cache_config
        return {
            **plan,
            "tokens": t.tokens_that_fit(vllm_config, kv_cache_config, seqs),
            "num_blocks": kv_cache_config.num_blocks,
            "block_size": cache_config.block_size,
            "mamba_block_size": cache_config.mamba_block_size,
            "mamba_cache_mode": getattr(cache_config, "mamba_cache_mode", None),
        }


def run_tree(tree: Path, budget: int, seqs: int) -> list[dict]:
    """Every scenario, in this process, on ``tree``."""
    import tqharness as h

    h.use_tree_env(tree)
    h.install_platform(tree)
    results = []
    for model, dtype, skip in scenarios():
        skipped = skipped_layers(model, skip)
        try:
            result = measure(model, dtype, skipped, budget, seqs)
        except Exception as e:  # noqa: BLE001 (reported in the table)
            result = {"error": f"{type(e).__name__}: {e}"[:200]}
        results.append({"model": model, "dtype": dtype, "skip": skipped, **result})
    return results


def cells(result: dict) -> list[str]:
    if "error" in result:
        return [result["error"].split(":")[0], "", "", ""]
    tq = "/".join(map(str, result["tq"])) or "-"
    skip = "/".join(f"{b:g}" for b in result["native"]) if result["skip"] else "-"
    pages = result["mamba_page"]
    ratio = "/".join(f"{page / result['mamba_state']:.2f}x" for page in pages)
    return [f"{result['tokens']:,}", tq, skip, ratio]


def table(labels: list[str], per_tree: list[list[dict]]) -> str:
    head = ["model", "kv cache dtype", "skip"]
    for label in labels:
        head += [f"{label}: tokens", "TQ B/tok", "skip B/tok", "Mamba/state"]
    rows = [head]
    for i, (model, dtype, _) in enumerate(scenarios()):
        skip = str(per_tree[0][i]["skip"]) if per_tree[0][i]["skip"] else "-"
        row = [model, "bf16" if dtype == "auto" else dtype, skip]
        for results in per_tree:
            row += cells(results[i])
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", metavar="LABEL=DIR")
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    if args.one:
        print(json.dumps(run_tree(args.one.resolve(), budget, args.seqs)))
        return 0
    if not args.trees:
        parser.error("name at least one tree: LABEL=DIR")
    labels, per_tree = [], []
    for spec in args.trees:
        label, _, tree = spec.rpartition("=")
        if not (Path(tree) / "vllm" / "__init__.py").is_file():
            parser.error(f"{tree}: no vllm/__init__.py")
        cmd = [sys.executable, __file__, "--one", tree, "--seqs", str(args.seqs)]
        cmd += ["--budget-gib", str(args.budget_gib)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{tree}: {out.stderr.strip()[-2000:]}")
        labels.append(label or Path(tree).name)
        per_tree.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"KV cache capacity: {args.budget_gib:g} GiB, {args.seqs} running "
        "sequences (tokens = sequences x the longest length each can have)"
    )
    print(table(labels, per_tree))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"budget_bytes": budget, "seqs": args.seqs, "trees": {}}
        data["trees"] = {label: r for label, r in zip(labels, per_tree, strict=True)}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
