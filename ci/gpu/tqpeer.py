"""vllm#53060's TurboQuant decode (issue 38's peer: xupinjie/vllm, branch
pinjie/turboquant_opt_v2, commit ae702ab8d) beside v0.33.0's and the
grouped one in tq_decode_bench.py: its CUDA sources, staged in .peer/ by
peer_stage.sh (never tracked), built here as a torch extension; the same
cache bytes in its page-local layout; its calls; and every kernel's error
against float64 attention over the K/V the cache bytes decode to.

Same quantization, read from both store kernels (v0.33.0's
triton_turboquant_store.py, the peer's at ae702ab8d) and both decoders:
keys are 4-bit indices into the same Lloyd-Max centroids (16, fp32) of the
key divided by its norm and rotated by the same orthonormal Sylvester
Hadamard (``x_hat @ PiT``, H / sqrt(D), symmetric), two codes a byte, dim
2i in the low nibble; the fp16 norm is the raw ||k||; both decoders apply
the norm correction (score = norm * <q_rot, c> / ||c||); values are
``code * scale + zero`` with fp16 scale and zero, the same nibble order.
The peer's decoders ignore the rotation argument and rotate the query with
an in-kernel Walsh-Hadamard transform in Sylvester order (the same H), the
softmax scale D^-0.5 folded in. Only the places of the bytes differ:

  v0.33.0 (blocks, block, Hk, slot): a slot is [key codes D/2][norm 2]
      [value codes D/2][scale 2][zero 2] (262 bytes at D 256)
  peer (blocks, Hk, 1, block * (D + 6)): a (block, head) record is
      [key codes block x D/2][value codes block x D/2][norms block x 2]
      [scales block x 2][zeros block x 2]

so ``to_peer_layout`` moves bytes and changes no value. What the peer
rounds on the way (its own decode, not the cache): the rotated query and
the centroids to fp16 (tensor-core path; fp32 on its SIMT path), V
dequantized in fp16 (``__hfma2``), P in fp16 for the PV MMA.

Its own dispatch (``run_with_workspace``) takes the tensor-core kernel at
GQA 4 only when B x Hk >= the SM count, else its SIMT kernel;
``peer_mma`` forces the tensor-core kernel (ci/gpu/peer_mma.cpp) at
``mma_splits``: about two resident CTAs a SM (its launch bounds at D 256).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
PRESET = "turboquant_4bit_nc"  # the only preset the peer decodes
SOURCES = ("main.cpp", "kernel.cu", "mma_kernel.cu")


def ninja_on_path() -> str | None:
    """ninja for torch's extension builder: on PATH, or the ninja wheel's
    binary in a ``bin/`` beside a sys.path entry (pip --target)."""
    if shutil.which("ninja"):
        return shutil.which("ninja")
    for entry in sys.path:
        binary = Path(entry or ".") / "bin" / "ninja"
        if binary.is_file():
            os.environ["PATH"] = f"{binary.parent}{os.pathsep}{os.environ['PATH']}"
            return str(binary)
    return None


def build(peer_dir: str | Path, build_dir: str | Path | None = None) -> SimpleNamespace:
    """Compile the staged sources and peer_mma.cpp with this machine's nvcc
    for its GPU (-O3 --use_fast_math); returns the extension
    (workspace_size, run_with_workspace), torch.ops.tqpeer.mma_decode and
    how it was built."""
    from torch.utils import cpp_extension

    peer = Path(peer_dir).resolve()
    missing = [s for s in SOURCES + ("kernel.h",) if not (peer / s).is_file()]
    if missing:
        raise FileNotFoundError(f"{peer}: no {missing} (ci/gpu/peer_stage.sh)")
    ninja = ninja_on_path()
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    out = Path(build_dir or "/tmp/tqpeer-build")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ext = cpp_extension.load(
        name="tqpeer_ext",
        sources=[str(peer / s) for s in SOURCES] + [str(HERE / "peer_mma.cpp")],
        extra_include_paths=[str(peer)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math"],
        build_directory=str(out),
        verbose=True,
    )
    nvcc = Path(cpp_extension.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    info = {
        "source": (peer / "SOURCE").read_text().strip() if (peer / "SOURCE").is_file() else "?",
        "build_s": round(time.time() - t0, 1),
        "arch": f"sm_{major}{minor}",
        "nvcc": version.stdout.strip().splitlines()[-1:],
        "ninja": ninja,
        "flags": "-O3 --use_fast_math",
    }
    return SimpleNamespace(ext=ext, mma=torch.ops.tqpeer.mma_decode, info=info)


def try_build(peer_dir, errors: list) -> SimpleNamespace | None:
    """``build``, or None with the failure in ``errors`` (the bench goes on
    without the peer's columns)."""
    if not torch.cuda.is_available():
        errors.append("peer: needs CUDA")
        return None
    try:
        peer = build(peer_dir)
    except Exception:
        errors.append("peer build: " + traceback.format_exc()[-3000:])
        print(errors[-1], flush=True)
        return None
    print(f"peer built: {peer.info}", flush=True)
    return peer


def to_peer_layout(slots: torch.Tensor, cfg, step: int = 1 << 15) -> torch.Tensor:
    """The bytes of a v0.33.0 turboquant_4bit_nc cache (blocks, block, Hk,
    slot) in the peer's page-local layout (blocks, Hk, 1, block * (D + 6)),
    ``step`` blocks at a time; no value changes."""
    nb, bs, hk, _ = slots.shape
    d = cfg.head_dim
    if cfg.key_fp8 or cfg.key_mse_bits != 4 or cfg.effective_value_quant_bits != 4:
        raise ValueError("the peer decodes turboquant_4bit_nc only")
    kc = cfg.key_packed_size - 2  # D/2 key code bytes, then the norm
    vc = math.ceil(d * 4 / 8)
    cuts = ((0, kc), (kc + 2, kc + 2 + vc), (kc, kc + 2),
            (kc + 2 + vc, kc + 4 + vc), (kc + 4 + vc, kc + 6 + vc))  # fmt: skip
    out = torch.empty(nb, hk, 1, bs * (d + 6), dtype=torch.uint8, device=slots.device)
    for a in range(0, nb, step):
        part = slots[a : a + step].permute(0, 2, 1, 3)  # (n, Hk, block, slot)
        n = part.shape[0]
        out[a : a + n, :, 0] = torch.cat(
            [part[..., x:y].reshape(n, hk, -1) for x, y in cuts], -1
        )
    return out


def mma_splits(batch: int, hk: int, length: int, sms: int) -> int:
    """Splits of the forced tensor-core path: about two resident CTAs a SM
    (one CTA a (request, KV head, split)), 1 .. min(64, 64-token tiles)."""
    want = round(2 * sms / (batch * hk))
    return max(1, min(64, math.ceil(length / 64), want))


def calls(peer, kv: torch.Tensor, layer, q: torch.Tensor, table: torch.Tensor,
          seq_lens: torch.Tensor, length: int, block: int) -> tuple[dict, dict]:  # fmt: skip
    """The peer's two calls on ``kv`` (its layout) for queries ``q`` (B, Hq,
    D) bf16, each returning its output: ``peer`` (its own dispatch, the
    backend's call) and ``peer_mma`` (the tensor-core path forced); and
    what they ran (splits, workspace, the dispatch's path)."""
    b, hq, d = q.shape
    hk, dev = kv.shape[1], q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws_bytes = peer.ext.workspace_size(
        b, hq, hk, table.stride(0), block, d, length, dev.index or 0
    )
    ws = torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device=dev)
    s = mma_splits(b, hk, length, sms)
    part_o = torch.empty(s * b * hq * d if s > 1 else 1, device=dev)
    part_ml = torch.empty(s * b * hq * 2 if s > 1 else 1, device=dev)
    out, out_mma = torch.empty_like(q), torch.empty_like(q)
    cen = layer._tq_centroids.float().contiguous()
    rot = layer._tq_Pi.float().contiguous()  # checked, not read, by the peer

    def own():
        peer.ext.run_with_workspace(q, kv, table, seq_lens, rot, cen, ws, out, block, length)
        return out

    def mma():
        peer.mma(q, kv, table, seq_lens, cen, part_o, part_ml, out_mma, block, s)
        return out_mma

    meta = {"peer_mma_splits": s, "peer_workspace_bytes": ws_bytes,
            "peer_path": "mma" if b * hk >= sms else "simt"}  # fmt: skip
    return {"peer": own, "peer_mma": mma}, meta


def check(peer, batch, impl, layer, block: int, want: torch.Tensor) -> dict:
    """The peer on tq_decode_bench.check's decode step (context written by
    the harness, the new tokens by v0.33.0's store): max |error| of both paths against ``want``, on the
    cache as the harness leaves it (slots nobody wrote hold random bytes)
    and with those slots zeroed (``_zeroed``: as vLLM allocates a cache)."""
    import tqbatches as tb

    cam = batch.cam
    q = tb.plain(batch.query).view(-1, impl.num_heads, impl.head_size).contiguous()
    table = tb.plain(cam.block_table_tensor).to(torch.int32).contiguous()
    seq_lens = tb.plain(cam.seq_lens).to(torch.int32).contiguous()
    raw = tb.plain(batch.kv_slots)
    zeroed = raw.clone(memory_format=torch.contiguous_format)
    flat = zeroed.view(-1, *zeroed.shape[2:])
    unwritten = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    written = torch.cat([tb.plain(s) for s in batch.slots]).long()
    unwritten[written.to(flat.device)] = False
    flat[unwritten] = 0
    res, n = {}, want.shape[0]
    for tag, slots in (("", raw), ("_zeroed", zeroed)):
        kv = to_peer_layout(slots, impl.tq_config)
        fns, _ = calls(peer, kv, layer, q, table, seq_lens, table.shape[1] * block, block)
        for name, fn in fns.items():
            got = fn()[:n].reshape(want.shape).double().cpu()
            res[f"err_{name}{tag}"] = float((got - want).abs().max())
    return res


def reference_shape(impl, layer, slots: torch.Tensor, hq: int, block: int):
    """tq_decode_accuracy.Shape's float64 decode (dequant, reference) over
    the bench's cache ``slots``, without building a second impl."""
    import tq_decode_accuracy as acc
    import tqbatches as tb

    hk, d = slots.shape[2], impl.head_size
    acc.HK, acc.BLOCK = hk, block
    ns = SimpleNamespace(
        cfg=impl.tq_config, d=d, gqa=hq // hk, hq=hq, impl=impl,
        cache=SimpleNamespace(slots=slots),
        hadamard=tb._hadamard(d).to(slots.device),
        centroids=layer._tq_centroids.double(),
    )  # fmt: skip
    ns.dequant = functools.partial(acc.Shape.dequant, ns)
    ns.reference = functools.partial(acc.Shape.reference, ns)
    return ns


def errors(ref_shape, q: torch.Tensor, table: torch.Tensor, length: int,
           fns: dict) -> dict:  # fmt: skip
    """Relative L2 error of each call's output (B, Hq, D) on requests 0 and
    B - 1 against float64 attention over the K/V the cache bytes decode
    to (every request holds ``length`` tokens)."""
    rows = sorted({0, q.shape[0] - 1})
    t0 = time.time()
    ref = torch.stack([ref_shape.reference(q[r], table[r], length) for r in rows])
    res = {"err_rows": rows, "ref_s": round(time.time() - t0, 2)}
    for name, fn in fns.items():
        try:
            got = fn()[rows].double().reshape(ref.shape)
            res[f"err_{name}"] = float((got - ref).norm() / ref.norm())
        except Exception as e:  # recorded beside the others
            res[f"err_{name}"] = f"{type(e).__name__}: {e}"[:200]
    return res
