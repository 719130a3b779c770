"""Attention and cache contents as trained models have them, for the decode
accuracy suite (tq_decode_accuracy.py --data ATTN:VALUES,...; issue 51).

ATTN, the queries of the checked requests:
  flat      random (nearly flat attention over a random cache)
  sink      aimed at the request's first token: it scores SINK_NATS above
            the mean of the others, which spread by their keys' angles to it
            (about SINK_NATS / sqrt(D) nats)
  sink-mid  the same at a token inside a split (L / 2 + 7)
  sinks     four such tokens (0, L / 3, 2 L / 3, L - 3)
  window    the last WINDOW tokens, each about WINDOW_NATS above the rest
VALUES, the cache's value (and FP8 key) fields, after tq_decode_bench.fill_fields:
  normal    as the store gives N(0, 1) inputs
  small     scales and zero points / 16 (values of std about 0.08)
  large     scales and zero points x 16
  outlier   the first 8 value channels at their largest code in every token,
            and FP8 keys' first 4 channels at 24
"""

from __future__ import annotations

import math

import torch

SINK_NATS, WINDOW, WINDOW_NATS = 16.0, 16, 12.0
ATTENTION = ("flat", "sink", "sink-mid", "sinks", "window")
VALUES = ("normal", "small", "large", "outlier")


def parse(spec: str) -> list[tuple[str, str]]:
    """'sink:small,flat:normal' -> [(attention, values), ...], checked."""
    modes = []
    for item in spec.split(","):
        attn, _, vals = item.partition(":")
        vals = vals or "normal"
        if attn not in ATTENTION or vals not in VALUES:
            msg = f"--data: {item!r}: ATTN in {ATTENTION}, VALUES in {VALUES}"
            raise SystemExit(msg)
        modes.append((attn, vals))
    return modes


def value_fields(cfg) -> tuple[int, int]:
    """Byte offsets of the value codes and of the value scale in a slot."""
    codes = cfg.key_packed_size
    return codes, codes + math.ceil(cfg.head_dim * cfg.effective_value_quant_bits / 8)


def set_values(slots: torch.Tensor, cfg, kind: str) -> None:
    """The VALUES transform of a cache filled by fill_fields, in place."""
    flat = slots.view(-1, slots.shape[2], slots.shape[3])
    codes, scale = value_fields(cfg)
    step = 1 << 20
    for a in range(0, flat.shape[0], step):
        part = flat[a : a + step]
        if kind in ("small", "large"):
            fields = part[..., scale : scale + 4].contiguous().view(torch.float16)
            factor = 1 / 16 if kind == "small" else 16.0
            part[..., scale : scale + 4] = (fields * factor).view(torch.uint8)
        elif kind == "outlier":
            # 8 channels: 4 bytes of 4-bit codes, 3 bytes of 3-bit codes
            width = 4 if cfg.effective_value_quant_bits == 4 else 3
            part[..., codes : codes + width] = 0xFF
            if cfg.key_fp8:
                part[..., :4] = 0x5C  # e4m3: 24


def aim(q: torch.Tensor, keys, length: int, kind: str, scale: float) -> None:
    """The ATTN transform of one request's query ``q`` (Hq, D), in place;
    ``keys(positions)`` gives those tokens' keys (n, Hk, D) float64."""
    if kind == "flat":
        return
    if kind == "window":
        pos, nats = list(range(length - WINDOW, length)), WINDOW_NATS
    else:
        nats = SINK_NATS
        pos = {"sink": [0], "sink-mid": [length // 2 + 7]}.get(
            kind, [0, length // 3, 2 * length // 3, length - 3]
        )
    k = keys(torch.tensor(pos, device=q.device))
    aimed = (k / (k * k).sum(-1, keepdim=True)).sum(0) * (nats / scale)
    group = q.shape[0] // aimed.shape[0]
    q.copy_(aimed.repeat_interleave(group, 0).to(q.dtype))
