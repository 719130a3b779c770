"""Turn the campaign's results into markdown tables (run HERE, after copying
each call's $OUT files into ci/gpu/results/engine/):

    python3 ci/gpu/engine/summarize.py [--results ci/gpu/results/engine] [--out tables.md]

Reads every c*_results.json (driver.py) and c*_setup.log; writes
RESULTS/tables.md:
  1. outcome per scenario x release x unpatched/patched, with the first line
     of the error (the innermost one naming the bug where there is a chain);
  2. GPU memory after each continuation request (v0.20.2's per-layer buffers,
     the shared workspace);
  3. output equality: greedy token ids with CUDA graphs vs eager (and patched
     vs unpatched where both served);
  4. TurboQuant vs kv_cache_dtype auto: per-token logprob difference;
  5. decode throughput (output tok/s), batch 1 and 32;
  6. the continuation-prefill kernel benchmark on the wheels' flash-attn;
with the device, date and command of each call. The tables are written with
ci/gpu/mdtable.py, as the kernel-level ones are (ci/gpu/summarize.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import scenarios as S  # noqa: E402
from mdtable import BLANK, fmt_f, md_table  # noqa: E402

REPO = HERE.parents[2]
BUG_KEYS = (
    "Cannot copy between CPU and CUDA",
    "Workspace is locked",
    "TurboQuant KV cache is not supported",
)
MiB = 2**20


def load(results_dir: Path) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    calls: dict = {}
    for f in sorted(results_dir.glob("[cp][0-9]*_results.json")):
        d = json.loads(f.read_text())
        call = d.get("call", f.stem.split("_")[0])
        for r in d["results"]:
            r["call"] = call
            rows.append(r)
        setup = results_dir / f"{call}_setup.log"
        lines = setup.read_text(errors="replace").splitlines() if setup.exists() else []
        header = next((h for h in lines[:3] if h.startswith("==")), "")
        calls[call] = {"header": header, "n": len(d["results"])}
    return rows, calls


def key(r: dict) -> tuple[str, str, str]:
    return r["release"], r["variant"], r["scenario"]


def err_line(r: dict) -> str:
    e = r.get("error") or {}
    first = e.get("first_line", "")
    for c in e.get("chain") or []:
        if any(k in c.get("first_line", "") for k in BUG_KEYS):
            return f"{c['type']}: {c['first_line']}"
    return f"{e.get('type', '')}: {first}" if e else ""


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    o = r.get("outcome", "?")
    if o == "ok":
        extra = ""
        if r.get("long"):
            n = sum(1 for x in r["long"] if not x.get("failed"))
            extra = f" ({n}/{len(r['long'])} long)"
        return "serves" + extra
    if o.startswith("skipped"):
        return o
    ph = r.get("phase", "")
    where = {
        "init": "startup",
        "short": "short prompts",
        "long": "continuation request",
    }.get(ph, ph)
    line = err_line(r)
    return f"**{o}** at {where}: `{line[:140]}`" if line else f"**{o}**"


def doc(scn: str) -> str:
    return f"{scn}: {S.SCENARIOS[scn]['doc']}"


def table_outcomes(rows: list[dict]) -> str:
    engine = [
        r for r in rows if S.SCENARIOS.get(r["scenario"], {}).get("kind") == "engine"
    ]
    cols = sorted(
        {(r["release"], r["variant"]) for r in engine},
        # the release, patched, then other variants by name (a set's order
        # decided between patched and kvfix before)
        key=lambda x: (x[0], x[1] != "unpatched", x[1] != "patched", x[1]),
    )
    by = {key(r): r for r in rows}
    out = []
    for n, s in S.SCENARIOS.items():
        if s["kind"] != "engine" or not any((rel, var, n) in by for rel, var in cols):
            continue
        cells = [cell(by.get((rel, var, n))) for rel, var in cols]
        out.append([f"{n}: {s.get('doc', '')}", *cells])
    header = ["scenario", *(f"{rel} {var}" for rel, var in cols)]
    return "\n".join(md_table(header, out))


def table_memory(rows: list[dict]) -> str:
    out = []
    for r in rows:
        for x in r.get("long") or []:
            m = x.get("mem")
            head = [r["release"], r["variant"], r["scenario"], x["label"]]
            if not m:
                if x.get("failed"):
                    failed = f"**failed: {err_line(r)[:80]}**"
                    out.append([*head, BLANK, failed, BLANK, BLANK])
                continue
            ws = m.get("workspace_bytes")
            ws_s = f"{ws / MiB:.2f}" if isinstance(ws, int) else str(ws)
            tq = m.get("tq_layer_tensor_bytes", 0) / MiB
            alloc = f"{m['allocated'] / MiB:.0f}"
            out.append([*head, x.get("num_cached_tokens"), alloc, f"{tq:.1f}", ws_s])
    header = ["release", "variant", "scenario", "request", "cached tokens reused"]
    header += ["allocated MiB", "TQ per-layer tensors MiB", "workspace MiB"]
    return "\n".join(md_table(header, out))


def first_divergence(ta: list, tb: list) -> int | None:
    if ta == tb:
        return None
    return next(
        (j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))
    )


def compare(a: dict, b: dict) -> dict:
    """Greedy outputs of the same prompts: identical sequences, first
    divergence, logprob differences of the chosen token where both agree."""
    sa, sb = a.get("short") or [], b.get("short") or []
    n = min(len(sa), len(sb))
    first_div = []
    dlp = []
    for i in range(n):
        ta, tb = sa[i]["token_ids"], sb[i]["token_ids"]
        first_div.append(first_divergence(ta, tb))
        la, lb = sa[i].get("logprobs") or [], sb[i].get("logprobs") or []
        for j in range(min(len(ta), len(tb), len(la), len(lb))):
            if ta[j] != tb[j]:
                break
            t = str(ta[j])
            if t in la[j] and t in lb[j]:
                dlp.append(abs(la[j][t] - lb[j][t]))
    return {
        "prompts": n,
        "identical": first_div.count(None),
        "first_divergence": first_div,
        "mean_abs_dlogprob": statistics.mean(dlp) if dlp else None,
        "max_abs_dlogprob": max(dlp) if dlp else None,
        "tokens_compared": len(dlp),
    }


def div_list(c: dict) -> str:
    return ",".join("-" if v is None else str(v) for v in c["first_divergence"])


def served(r: dict | None) -> bool:
    return bool(r) and (r.get("outcome") == "ok" or bool(r.get("short")))


def table_pairs(rows: list[dict], pairs: list[tuple[str, str, str]], title: str) -> str:
    by = {key(r): r for r in rows}
    out = []
    for rel, var in sorted({(r["release"], r["variant"]) for r in rows}):
        for x, y, label in pairs:
            a, b = by.get((rel, var, x)), by.get((rel, var, y))
            if not served(a) or not served(b):
                continue
            c = compare(a, b)
            out.append(
                [rel, var, label, f"{c['identical']}/{c['prompts']}", div_list(c)]
                + [c["tokens_compared"], fmt_f(c["mean_abs_dlogprob"], ".2e")]
                + [fmt_f(c["max_abs_dlogprob"], ".2e")]
            )
    header = ["release", "variant", title, "identical / prompts"]
    header += ["first divergence (token index per prompt)", "tokens compared"]
    header += ["mean abs d logprob", "max abs d logprob"]
    return "\n".join(md_table(header, out))


def table_variants_equal(rows: list[dict]) -> str:
    by = {key(r): r for r in rows}
    out = []
    for (rel, var, scn), r in sorted(by.items()):
        if var != "unpatched" or not r.get("short"):
            continue
        p = by.get((rel, "patched", scn))
        if not p or not p.get("short"):
            continue
        c = compare(r, p)
        mean = fmt_f(c["mean_abs_dlogprob"], ".2e")
        out.append([rel, scn, f"{c['identical']}/{c['prompts']}", mean])
    header = ["release", "scenario", "unpatched vs patched: identical / prompts"]
    return "\n".join(md_table([*header, "mean abs d logprob"], out))


def table_speed(rows: list[dict]) -> str:
    sp = [r for r in rows if r.get("speed") or (r["scenario"].startswith("s_"))]
    ref = {}
    for r in sp:
        if r["scenario"] in ("s_graph", "s_spec_graph") and r.get("speed"):
            ref[(r["release"], r["scenario"].replace("_graph", ""))] = r["speed"]
    out = []
    for r in sp:
        if not r.get("speed"):
            out.append(
                [r["release"], r["variant"], r["scenario"], cell(r), BLANK, BLANK]
            )
            continue
        b1 = r["speed"]["bs1"]["best_tok_per_s"]
        b32 = r["speed"]["bs32"]["best_tok_per_s"]
        base = r["scenario"]
        for workaround in ("_graph", "_none", "_eager"):
            base = base.replace(workaround, "")
        g = ref.get((r["release"], base))
        rat = ""
        if g:
            rat = (
                f"{b1 / g['bs1']['best_tok_per_s']:.2f} / "
                f"{b32 / g['bs32']['best_tok_per_s']:.2f}"
            )
        out.append([r["release"], r["variant"], doc(r["scenario"]), b1, b32, rat])
    header = ["release", "variant", "scenario", "batch 1 tok/s", "batch 32 tok/s"]
    return "\n".join(md_table([*header, "vs CUDA graphs (b1 / b32)"], out))


def table_bench(rows: list[dict]) -> str:
    runs: dict[str, dict] = {}
    meta = {}
    for r in rows:
        b = r.get("bench")
        if not b:
            continue
        v = r.get("bench_variant")
        meta[v] = (
            r["release"],
            r["variant"],
            b.get("reserved"),
            b.get("device"),
            r.get("real_flash_attn_varlen_func"),
        )
        for x in b.get("runs", []):
            runs.setdefault(f"{x['preset']}/{x['cached']}/{x['q']}", {})[v] = x
    if not runs:
        return "(no benchmark results)"
    variants = "; ".join(
        f"({v}) {m[0]} {m[1]}, flash-attn {m[4]}" for v, m in sorted(meta.items())
    )
    out, worst = [], []
    for k, d in runs.items():
        row, cb = bench_row(k, d)
        out.append(row)
        if cb and int(k.split("/")[1]) >= 32768:
            worst.append(cb)
    header = ["preset", "cached", "q_len", "floor ms", "(a) ms", "(b) ms", "(c) ms"]
    header += ["(c)/(b)", "(c)/floor", "peak a / b / c MiB"]
    lines = [f"variants: {variants}", "", *md_table(header, out), ""]
    for v, m in sorted(meta.items()):
        lines.append(f"- reserved ({v}) {m[0]} {m[1]}: {json.dumps(m[2])}")
    if worst:
        lines.append(
            f"- goal (c) <= 0.67 x (b) at 32K-128K: max (c)/(b) = {max(worst):.2f} -> "
            f"{'met' if max(worst) <= 0.67 else 'missed'}"
        )
    return "\n".join(lines)


def bench_row(k: str, d: dict) -> tuple[list, float | None]:
    """One shape of the benchmark ((a), (b), (c) side by side), and (c)/(b)."""
    preset, cached, q = k.split("/")
    fl = next(iter(d.values()))["floor"]["floor_ms"]

    def t(v: str) -> float | None:
        x = d.get(v)
        return x["time"]["median_ms"] if x and x.get("time") else None

    a, b, c = t("a"), t("b"), t("c")
    cb = c / b if (b and c) else None
    peaks = " / ".join(
        f"{d[v].get('peak_extra_bytes', 0) / MiB:.0f}" if d.get(v) else ""
        for v in "abc"
    )
    row = [preset.replace("turboquant_", ""), f"{int(cached) // 1024}K", q]
    row += [f"{fl:.3f}", fmt_f(a), fmt_f(b), fmt_f(c)]
    row += ["" if cb is None else f"**{cb:.2f}**"]
    row += ["" if c is None else f"{c / fl:.1f}", peaks]
    return row, cb


def lp_diff(a: list, b: list) -> tuple[float | None, float | None, int]:
    """Mean and max |a - b| over the positions both have."""
    d = [
        abs(x - y) for x, y in zip(a or [], b or []) if x is not None and y is not None
    ]
    return (statistics.mean(d) if d else None, max(d) if d else None, len(d))


def pfx_pair(a: dict, b: dict, first: str, second: str) -> dict:
    """Trials of two pfx results (or of one, first vs second of each trial):
    H's greedy tokens and tail prompt logprobs."""
    xs = [x[first] for x in a.get("trials") or []]
    ys = [y[second] for y in b.get("trials") or []]
    c = compare({"short": xs}, {"short": ys})
    plp = [lp_diff(x.get("prompt_lp"), y.get("prompt_lp")) for x, y in zip(xs, ys)]
    means = [m for m, _, n in plp if m is not None]
    maxes = [m for _, m, n in plp if m is not None]
    cached = "/".join(
        f"{x.get('num_cached_tokens')}:{y.get('num_cached_tokens')}"
        for x, y in zip(xs, ys)
    )
    return {
        **c,
        "plp_mean": statistics.mean(means) if means else None,
        "plp_max": max(maxes) if maxes else None,
        "plp_n": sum(n for *_, n in plp),
        "cached": cached,
    }


def table_pfx(rows: list[dict]) -> str:
    """vllm#46460: H batched with a longer fresh prompt vs H alone, and the
    reference noise (TurboQuant alone vs kv_cache_dtype auto alone)."""
    by = {key(r): r for r in rows}
    out = []
    for (rel, var, scn), r in sorted(by.items()):
        if scn not in ("pfx", "pfx_auto") or not r.get("trials"):
            continue
        kv = "auto" if scn == "pfx_auto" else "TurboQuant"
        pairs = [(r, r, "batched", "alone", f"{kv}: H batched with F vs H alone")]
        auto = by.get((rel, "unpatched", "pfx_auto"))
        if scn == "pfx" and auto and auto.get("trials"):
            label = "H alone: auto vs TurboQuant (reference noise)"
            pairs.append((auto, r, "alone", "alone", label))
        for a, b, f, g, label in pairs:
            c = pfx_pair(a, b, f, g)
            plp = (
                f"{fmt_f(c['plp_mean'], '.2e')} / {fmt_f(c['plp_max'], '.2e')} "
                f"({c['plp_n']})"
            )
            out.append(
                [rel, var, label, c["cached"], f"{c['identical']}/{c['prompts']}"]
                + [div_list(c), plp, fmt_f(c["mean_abs_dlogprob"], ".2e")]
            )
    header = ["release", "variant", "comparison", "H cached tokens (per trial, a:b)"]
    header += ["greedy tokens identical / trials", "first divergence per trial"]
    header += ["tail prompt logprobs: mean / max abs d (positions)"]
    header += ["generated logprob mean abs d (agreed prefix)"]
    return "\n".join(md_table(header, out))


def div_gap(ref: dict, got: dict) -> str:
    """First divergence of got from ref, and there the reference's logprob of
    its own token minus that of got's token (a near-tie is a small gap)."""
    a, b = ref["token_ids"], got["token_ids"]
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return "-" if len(a) == len(b) else f"len {len(b)}"
    d = (ref.get("logprobs") or [{}] * (j + 1))[j]
    mine, other = d.get(str(a[j])), d.get(str(b[j]))
    if mine is None:
        return str(j)
    gap = (
        f"{mine - other:.3f}" if other is not None else f">{mine - min(d.values()):.2f}"
    )
    return f"{j} ({gap})"


def spec_accept(r: dict) -> str:
    """Accepted / proposed draft tokens over the batch-1 runs (counter deltas)."""
    c = r.get("spec_counters") or {}
    s0, s1 = c.get("start") or {}, c.get("bs1") or {}

    def delta(part: str) -> float | None:
        ks = [
            k
            for k in s1
            if part in k and "per_pos" not in k and isinstance(s1[k], (int, float))
        ]
        return (s1[ks[0]] - (s0.get(ks[0]) or 0.0)) if ks else None

    acc, drafts = delta("num_accepted_tokens"), delta("num_draft_tokens")
    if acc is not None and drafts:
        return f"{acc / drafts:.2f} ({acc:.0f}/{drafts:.0f})"
    return "?"


def table_spec(rows: list[dict]) -> str:
    """Greedy output with speculation vs without (sd_ref of the same tree)."""
    by = {key(r): r for r in rows}
    out = []
    for (rel, var, scn), r in sorted(by.items()):
        if not scn.startswith("sd") or scn == "sd_ref":
            continue
        ref = by.get((rel, var, "sd_ref"))
        if r.get("outcome") != "ok" or not ref or not ref.get("spec_bs1"):
            why = cell(r) if r.get("outcome") != "ok" else "no sd_ref"
            out.append([rel, var, doc(scn), why, *[BLANK] * 5])
            continue
        c = compare({"short": ref["spec_bs1"]}, {"short": r["spec_bs1"]})
        cb = compare(
            {"short": ref["spec_batch"]["outputs"]},
            {"short": r["spec_batch"]["outputs"]},
        )
        gaps = ", ".join(div_gap(x, y) for x, y in zip(ref["spec_bs1"], r["spec_bs1"]))
        speeds = " / ".join(str(v) for v in (r.get("eq_speed") or {}).values())
        same_w = r.get("weights_digest") == ref.get("weights_digest")
        lp = (
            f"{fmt_f(c['mean_abs_dlogprob'], '.2e')} / "
            f"{fmt_f(c['max_abs_dlogprob'], '.2e')}"
        )
        out.append(
            [rel, var, doc(scn) + ("" if same_w else " **weights differ**")]
            + [f"{c['identical']}/{c['prompts']}", gaps, lp]
            + [f"{cb['identical']}/{cb['prompts']}", spec_accept(r), speeds]
        )
    header = ["release", "variant", "scenario", "identical / prompts (batch 1)"]
    header += ["first divergence per prompt (ref logprob gap there)"]
    header += ["chosen-token logprob mean / max abs d (agreed prefix)"]
    header += ["batch of 4: identical", "acceptance (batch 1)", "tok/s batch 1 / 4"]
    return "\n".join(md_table(header, out))


def table_spec_speed(rows: list[dict]) -> str:
    """The timed sdx_* runs (alone on the GPU): the fix against the
    workarounds, as ratios to the patched full-graph async run."""
    sx = [r for r in rows if r["scenario"].startswith("sdx_") and r.get("eq_speed")]
    base = {
        r["release"]: r["eq_speed"]
        for r in sx
        if r["scenario"] == "sdx_fa" and r["variant"] == "patched"
    }
    out = []
    for r in sorted(sx, key=lambda r: (r["release"], r["scenario"])):
        b1, b4 = r["eq_speed"].get("bs1_tok_per_s"), r["eq_speed"].get("bs4_tok_per_s")
        g = base.get(r["release"])
        rat = ""
        if g and b1 and b4:
            rat = f"{g['bs1_tok_per_s'] / b1:.2f} / {g['bs4_tok_per_s'] / b4:.2f}"
        out.append([r["release"], r["variant"], doc(r["scenario"]), b1, b4, rat])
    header = ["release", "variant", "scenario", "tok/s batch 1", "tok/s batch 4"]
    return "\n".join(md_table([*header, "patched sdx_fa / this (batch 1, 4)"], out))


EQ_PAIRS = [
    ("m1", "e_m1", "dense 4bit_nc graphs vs eager"),
    ("h1", "e_h1", "hybrid 4bit_nc graphs vs eager"),
    ("k_m1", "ke_m1", "dense k8v4 graphs vs eager"),
    ("k_h1", "ke_h1", "hybrid k8v4 graphs vs eager"),
]
AUTO_PAIRS = [
    ("a_m1", "m1", "dense: auto vs turboquant_4bit_nc"),
    ("a_h1", "h1", "hybrid: auto vs turboquant_4bit_nc"),
    ("a_m1", "k_m1", "dense: auto vs turboquant_k8v4"),
    ("a_h1", "k_h1", "hybrid: auto vs turboquant_k8v4"),
]


def report(rows: list[dict], calls: dict) -> str:
    """tables.md: the calls, then every table under its heading."""
    gpus = sorted({r.get("gpu") for r in rows if r.get("gpu")})
    dates = sorted({r.get("started", "")[:10] for r in rows if r.get("started")})
    head = [
        (
            "# GPU campaign: the release wheels' engine (generated by "
            "ci/gpu/engine/summarize.py)"
        ),
        "",
        f"Device: {', '.join(gpus) or '?'}; dates: {', '.join(dates) or '?'}.",
        (
            "Calls (ci/gpu/results/history/engine/PLAN.md; each "
            "`bash ci/gpu/engine/device/call.sh CALL` with carry `.dev/eng/CALL`):"
        ),
        *[f"- {c}: {v['header']} ({v['n']} jobs)" for c, v in sorted(calls.items())],
        "",
    ]
    pfx = (
        f"H = P + tail (P {S.PFX['prefix']} tokens, cached; tail {S.PFX['tail']}), "
        f"F a fresh prompt of {S.PFX['fresh']} tokens in the same step; "
        f"{S.PFX['trials']} trials, {S.PFX['max_tokens']} greedy tokens each; "
        "logprobs of H's last tail tokens (prompt logprobs) and of the generated ones."
    )
    spec = (
        f"{len(S.spec_prompts())} repetitive prompts, {S.SPEC_TOKENS} greedy tokens "
        "each, one at a time (batch 1) then all at once; sdx_* ran alone on the GPU "
        "(their tok/s are the speed comparison)."
    )
    sections = [
        ("1. Outcomes (unpatched release wheels vs patched)", [table_outcomes(rows)]),
        ("2. GPU memory after each continuation request", [table_memory(rows)]),
        (
            "3. Output equality (greedy token ids, 8 prompts x 32 tokens)",
            [table_pairs(rows, EQ_PAIRS, "pair"), table_variants_equal(rows)],
        ),
        (
            "4. TurboQuant vs kv_cache_dtype auto (same dummy model, CUDA graphs)",
            [table_pairs(rows, AUTO_PAIRS, "pair")],
        ),
        (
            "5. Decode throughput (short prompts: 32 tokens in, 256 out)",
            [table_speed(rows)],
        ),
        (
            (
                "6. Continuation prefill on the wheels' flash-attn "
                "(tq_continuation_bench shapes)"
            ),
            [table_bench(rows)],
        ),
        (
            "7. Prefix-cache hit batched with a longer fresh prompt (vllm#46460)",
            [pfx, table_pfx(rows)],
        ),
        (
            "8. Speculative decoding vs none (same tree; ngram, 3 draft tokens)",
            [spec, table_spec(rows), table_spec_speed(rows)],
        ),
    ]
    for title, blocks in sections:
        head += [f"## {title}", ""]
        for b in blocks:
            head += [b, ""]
    return "\n".join(head)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(REPO / "ci/gpu/results/engine"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rd = Path(a.results)
    rows, calls = load(rd)
    if not rows:
        print(f"no c*_results.json in {rd}")
        return 1
    text = report(rows, calls)
    out = Path(a.out) if a.out else rd / "tables.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
