"""Warp instructions a (token, KV head) in the token loop of a grouped decode
module's registers stage 1, compiled for sm_90 by Triton and ptxas on a
machine without a GPU (the arguments marked 16-byte aligned, as Triton's
launcher marks them on a GPU; without that every code byte is its own load).

    python ci/gpu/tq_sass_loop.py MODULE_FILE --tree TREE \\
        [--preset 4bit_nc] [--dim 256] [--gqa 4] [--dtype bf16] \\
        [--tokens 16] [--warps 1] [--stages 1] [--cap 0] [--slots]

Prints registers, stack bytes (spills), the loop's instruction count, per
(token, KV head), its asynchronous copies (LDGSTS: Triton's pipelining,
``--stages`` above 1) and its opcodes by count. MODULE_FILE: a grouped decode
module (the tree's, or a candidate); TREE: the vLLM source tree it imports
(centroids)."""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PRESETS = {"4bit_nc": (4, 4, 0), "k8v4": (4, 4, 1), "3bit_nc": (3, 3, 0),
           "k3v4_nc": (3, 4, 0)}  # fmt: skip
POINTERS = {"Q_ptr": "*fp32", "KV_cache_ptr": "*u8", "Half_ptr": "*fp16",
            "Block_table_ptr": "*i32", "Seq_lens_ptr": "*i32",
            "Centroids_ptr": "*fp32", "Mid_o_ptr": "*fp32",
            "Mid_lse_ptr": "*fp32"}  # fmt: skip


def constexprs(gd, a: argparse.Namespace) -> dict:
    kbits, vbits, fp8 = PRESETS[a.preset]
    kbytes = a.dim if fp8 else a.dim * kbits // 8
    row = kbytes + a.dim * vbits // 8
    tables = ("", "") if fp8 else gd._centroid_tables_ptx(a.dim, kbits)
    return {
        "HEAD_DIM": a.dim,
        "KV_GROUP_SIZE": a.gqa,
        "BLOCK_H": max(8, triton.next_power_of_2(a.gqa)),
        "BLOCK_SIZE": 16,
        "BLOCK_KV": a.tokens,
        "SLOT_ALIGN": 2 if a.slots else 16,
        "KEY_FP8": fp8,
        "KPS": kbytes + 2,
        "QK_SCALE": a.dim**-0.5 * 1.4426950408889634,
        "NORM_CORRECTION": 1 - fp8,
        "FP8_E4B15": 0,
        "KEY_BITS": kbits,
        "VALUE_BITS": vbits,
        "CENTROID_LOW": int(a.dtype == "fp16" and not fp8),
        "HIGH_TABLE": tables[0],
        "LOW_TABLE": tables[1],
        "PTX": 1,
        "SOA_META": 0 if a.slots else 16 * 4 * row,
    }


def compiled(gd, a: argparse.Namespace):
    fn = gd._tq_grouped_decode_regs_stage1
    const = constexprs(gd, a)
    types_ = dict(POINTERS)
    if const["KEY_FP8"]:
        types_["Q_ptr"] = "*bf16" if a.dtype == "bf16" else "*fp16"
    sig = {n: "constexpr" if n in const else types_.get(n, "i32") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n not in const and n != "num_splits"]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                           for n in aligned})  # fmt: skip
    options = {"num_warps": a.warps, "num_stages": a.stages}
    if a.cap:
        options["maxnreg"] = a.cap
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loop_body(sass: str) -> list[str]:
    """The instructions from the label of the longest backward branch to it."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, x in enumerate(lines) if (m := re.match(r"\s*(\w+):$", x))}
    spans = [(i - labels[m[1]], labels[m[1]], i) for i, x in enumerate(lines)
             if (m := re.search(r"BRA (\w+);", x)) and labels.get(m[1], i) < i]  # fmt: skip
    _, start, end = max(spans)
    return [x.split("\t", 1)[1] for x in lines[start + 1 : end + 1] if "\t" in x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module")
    ap.add_argument("--tree", required=True)
    ap.add_argument("--preset", default="4bit_nc", choices=PRESETS)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=1, help="Triton's num_stages")
    ap.add_argument("--cap", type=int, default=0, help="maxnreg (0: none)")
    ap.add_argument("--slots", action="store_true", help="slots, not SoA pages")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    sys.modules["vllm.triton_utils"] = types.SimpleNamespace(tl=tl, triton=triton)
    spec = importlib.util.spec_from_file_location("tq_sass_module", a.module)
    gd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gd)
    k = compiled(gd, a)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    body = loop_body(k.asm["sass"])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
                              for x in body)  # fmt: skip
    regs, stack = re.search(r"REG:(\d+)", usage)[1], re.search(r"STACK:(\d+)", usage)[1]
    print(
        f"registers {regs}, stack {stack} B, loop {len(body)} instructions, "
        f"{len(body) * a.warps / a.tokens:.1f} a (token, KV head), "
        f"{ops['LDGSTS']} asynchronous copies"
    )
    print(" ".join(f"{op}:{n}" for op, n in ops.most_common(20)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
