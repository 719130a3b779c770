"""The GPU rig's one summarizer: markdown tables (printed, and written to
OUT) from what a run left.

    python3 ci/gpu/summarize.py --work DIR --out OUT [--prev EARLIER_OUT]
    python3 ci/gpu/summarize.py --engine RESULTS [--out RESULTS/tables.md]

--work: run.sh's work folder (run.sh runs this last): the CUDA-graph checks
(tq_cudagraph.json), the continuation bench (tq_continuation_bench.json),
both again for the tq33 trees (tq33.json), the targeted tests (tests.json)
and tables.md. The output errors between trees come from the samples
(*.pt, not kept), else from --prev's JSON.

--engine: every CALL_results.json of run.sh's engine part in RESULTS (each
call's four files copied there): outcome per scenario x release x variant
(with the error naming the bug), GPU memory after each continuation
request, output equality (graphs vs eager, unpatched vs patched, TurboQuant
vs auto), decode throughput, the continuation kernel on the wheels'
flash-attn, the prefix hit batched with a fresh prompt, speculative
decoding against none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine"))
import scenarios as S  # noqa: E402

MiB = 2**20

# --------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------


class _Blank:
    def __str__(self) -> str:
        return ""


BLANK = _Blank()  # a cell left empty: "| |" (a value formatted as "" is "|  |")


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The header line, the separator line, then one line per row; each
    cell as an f-string writes it, a space either side."""
    def line(cells):
        return "|" + "".join(" |" if c is BLANK else f" {c} |" for c in cells)

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def fmt(x: object, nd: int = 2) -> str:
    """A float to ``nd`` decimals (other values as they are), "-" for None."""
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else f"{x}"


def fmt_f(x: float | None, spec: str = ".2f") -> str:
    """A number in ``spec`` (".2e", ".3f", ...), "" for None."""
    return "" if x is None else format(x, spec)


# --------------------------------------------------------------------------
# run.sh's kernel-level parts
# --------------------------------------------------------------------------


def load(p: Path):
    try:
        return json.loads(p.read_text())
    except Exception:
        return None


def load_pt(p: Path):
    try:
        import torch

        return torch.load(p)
    except Exception:
        return None


def rel(a, b) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    d = (a.float() - b.float()).norm()
    return float(d / b.float().norm().clamp_min(1e-30))


PREV: dict = {}  # --prev: results of an earlier summary (cross-checks)


def cudagraph(work: Path, lines: list[str], pre: str = "cg", title: str = "Issue 4") -> dict:
    """tq_cudagraph.py's tables: syncs, capture, replay; the step's time."""
    base, pat = load(work / f"{pre}_base.json"), load(work / f"{pre}_patched.json")
    res = {"base": base, "patched": pat}
    if not base and not pat:
        lines.append(f"\n({title}: no cudagraph results)\n")
        return res
    sb, sp = (load_pt(work / f"{pre}_samples_{x}.pt") for x in ("base", "patched"))
    dev = (pat or base)["device"]
    lines.append(f"\n### {title}: CUDA-graph capture, syncs ({dev.get('device')})\n")
    rows, res["patched_vs_base_eager_rel_err"] = scenario_rows(base, pat, sb, sp)
    header = ["mode/scenario"]
    for side in ("base", "patched"):
        header += [f"{side} syncs/step", f"{side} sync 'error'", f"{side} capture",
                   f"{side} replay == eager (max abs diff)"]  # fmt: skip
    lines += md_table([*header, "patched vs base eager (rel)"], rows)
    timing_rows(base, pat, lines)
    return res


def capture_cell(x: dict) -> str:
    if "error" in x:
        return "error: " + x["error"][:80]
    if x.get("capture") == "failed":
        return "FAILS: " + x.get("capture_error", "")[:90]
    return x.get("capture", x.get("skipped", "-"))


def replay_cell(x: dict) -> str:
    rp = x.get("replay")
    if not rp:
        return "-"
    ok = rp["ok"] and all(o["bit_exact"] for o in rp["replays"])
    diffs = ", ".join(f"{o['max_abs_diff']:.2g}" + (" bit-exact" if o["bit_exact"] else "")
                      for o in rp["replays"])  # fmt: skip
    return ("yes" if ok else "NO") + f" ({diffs})"


def drop_notice(x: dict) -> None:
    """The one-time notice of set_sync_debug_mode counted as a sync by older
    runs: not a sync."""
    sy = x.get("sync", {})
    if any("prototype feature" in m for m in sy.get("sync_messages", [])):
        sy["syncs_per_step"] -= 1
        sy["sync_messages"] = [m for m in sy["sync_messages"] if "prototype" not in m]


def scenario_rows(base, pat, sb, sp) -> tuple[list[list], dict]:
    """One row per scenario, base beside patched; patched vs base eager
    output (rel err) by scenario."""
    keys = list((pat or {}).get("scenarios") or (base or {}).get("scenarios") or {})
    rows, cross = [], {}
    for k in keys:
        b = (base or {}).get("scenarios", {}).get(k, {})
        p = (pat or {}).get("scenarios", {}).get(k, {})
        r = rel(sp.get(k) if sp else None, sb.get(k) if sb else None)
        if r is None:  # samples not kept: the earlier summary's figure
            r = PREV.get("cg", {}).get("patched_vs_base_eager_rel_err", {}).get(k)
        cross[k] = r
        row = [k]
        for x in (b, p):
            drop_notice(x)
            sy = x.get("sync", {})
            row += [sy.get("syncs_per_step", "-"), sy.get("error_mode", "-")[:70],
                    capture_cell(x), replay_cell(x)]  # fmt: skip
        rows.append([*row, fmt(r, 4)])
    return rows, cross


def timing_rows(base, pat, lines: list[str]) -> None:
    lines.append("\nPrefill step, batch of 8 continuation requests over 4096 cached "
                 "tokens each (store + forward), ms:\n")  # fmt: skip
    rows = []
    for k in (pat or {}).get("timing") or (base or {}).get("timing") or {}:
        b = (base or {}).get("timing", {}).get(k, {})
        p = (pat or {}).get("timing", {}).get(k, {})
        bw, pw = b.get("eager_wall_ms_per_step"), p.get("eager_wall_ms_per_step")
        rows.append([k, fmt(bw, 3), fmt(pw, 3), fmt(pw / bw if bw and pw else None, 2),
                     fmt(b.get("eager_gpu_ms_per_step"), 3), fmt(p.get("eager_gpu_ms_per_step"), 3),
                     fmt(p.get("graph_wall_ms_per_step"), 3),
                     b.get("sync", {}).get("syncs_per_step", "-")])  # fmt: skip
    header = ["mode/batch", "base wall/step", "patched wall/step", "patched/base"]
    header += ["base GPU/step", "patched GPU/step", "patched graph replay wall/step"]
    lines += md_table([*header, "base syncs/step"], rows)


def bench(work: Path, lines: list[str], pre: str = "bench", title: str = "Issue 3") -> dict:
    """The continuation bench's tables: reserved memory, time per call,
    kernel split, the stand-in's check."""
    v = {x: load(work / f"{pre}_{x}.json") for x in "abc"}
    s = {x: load_pt(work / f"{pre}_samples_{x}.pt") for x in "abc"}
    res: dict = {"variants": v, "rows": [], "targets": {}}
    if not any(v.values()):
        lines.append(f"\n({title}: no bench results)\n")
        return res
    anyv = next(x for x in v.values() if x)
    ceil = anyv["ceilings"]
    lines.append(f"\n### {title}: continuation prefill ({anyv['device'].get('device')})\n")
    lines.append(f"Ceilings measured in the run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} "
                 f"TB/s (read+write), bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} "
                 f"TFLOP/s. Shapes {anyv['shape']}.")  # fmt: skip
    reserved_table(v, lines, res)
    by = {x: {(r["preset"], r["mode"], r["cached"], r["q"]): r for r in (v[x] or {}).get("runs", [])}
          for x in "abc"}  # fmt: skip
    time_table(by, s, lines, res)
    split_table(v, lines)
    c = v["c"] or {}
    if "shim_check" in c:
        lines.append("\nFA2 stand-in vs the float64 reference (rel err of out, max abs "
                     "err of LSE): " + json.dumps(c["shim_check"]))  # fmt: skip
    return res


def reserved_table(v: dict, lines: list[str], res: dict) -> None:
    lines.append("\nReserved continuation memory (bytes, MiB):\n")
    rsv, rows = {}, []
    mmls = sorted({m for x in v.values() if x for m in x.get("reserved", {})}, key=int)
    for mml in mmls:
        a = (v["a"] or {}).get("reserved", {}).get(mml, {}).get("per_layer_bytes")
        b = (v["b"] or {}).get("reserved", {}).get(mml, {}).get("workspace_bytes")
        c = (v["c"] or {}).get("reserved", {}).get(mml, {}).get("workspace_bytes")
        rsv[mml] = {"a_per_layer": a, "b": b, "c": c}
        rows.append([mml, f"{fmt(a / MiB if a else None, 0)} per layer",
                     fmt(b / MiB if b else None, 0), fmt(c / MiB if c else None, 0),
                     fmt(c / b if b and c else None, 4)])  # fmt: skip
    header = ["max_model_len", "(a) v0.20.2 per-layer buffers"]
    header += ["(b) v0.21.0 + v0.24.0 reservation", "(c) patched", "(c)/(b)"]
    lines += md_table(header, rows)
    cr = [rsv[m]["c"] for m in rsv]
    b128, c128 = rsv[mmls[0]]["b"], rsv[mmls[0]]["c"]
    res["targets"]["reserved_independent_of_max_model_len"] = bool(cr[0] and cr[0] == cr[1])
    res["targets"]["reserved_c_le_b_over_8_at_128K"] = bool(b128 and c128 and c128 <= b128 / 8)
    res["reserved"] = rsv


def time_table(by: dict, s: dict, lines: list[str], res: dict) -> None:
    keys = list(dict.fromkeys(k for x in "cba" for k in by[x]))
    lines.append("\nTime per call (median, ms), measured/floor, extra peak memory during "
                 "the call (MiB):\n")  # fmt: skip
    worst: dict = {}
    rows = []
    for k in keys:
        cells, row = time_row(k, {x: by[x].get(k) for x in "abc"}, s)
        rows.append(cells)
        res["rows"].append(row)
        if k[2] >= 32768 and row["c_over_b"] is not None:
            worst[k[1]] = max(worst.get(k[1], 0.0), row["c_over_b"])
    header = ["preset", "mode", "cached", "q", "floor ms", "(a) ms", "(b) ms"]
    header += ["(c) ms", "(c)/(b)", "(a)/floor", "(b)/floor", "(c)/floor"]
    header += ["peak+ a/b/c MiB", "rel err c vs b", "rel err c vs a"]
    lines += md_table(header, rows)
    for mode, w in worst.items():
        res["targets"][f"time_c_le_1.10_b_32K_128K_{mode}"] = {"max_ratio": w, "met": w <= 1.10}
    lines.append("\nTargets: " + json.dumps(res["targets"]))


def time_row(k: tuple, rows: dict, s: dict) -> tuple[list, dict]:
    """One shape's row of the time table, and its figures."""
    floor = next((r["floor"]["floor_ms"] for r in rows.values() if r), None)

    def t(x):
        return (rows[x] or {}).get("time", {}).get("median_ms")

    def ts(x):
        r = rows[x]
        if not r:
            return "-"
        if "error" in r:
            return "OOM" if r["error"].startswith("OOM") else "error"
        return fmt(t(x), 3)

    def per_floor(x):
        return fmt(t(x) / floor if t(x) and floor else None, 1)

    ratio = t("c") / t("b") if t("b") and t("c") else None
    ekey = "/".join(map(str, k))
    prev = next((x for x in PREV.get("bench", {}).get("rows", []) if x["key"] == ekey), {})
    errs = {}
    for x in "ba":
        e = rel(s["c"].get(ekey) if s["c"] else None, s[x].get(ekey) if s[x] else None)
        errs[x] = e if e is not None else prev.get(f"rel_err_c_vs_{x}")
    peaks = "/".join(fmt(rows[x]["peak_extra_bytes"] / MiB, 0)
                     if rows[x] and "peak_extra_bytes" in rows[x] else "-" for x in "abc")  # fmt: skip
    cells = [k[0].replace("turboquant_", ""), *k[1:], fmt(floor, 3)]
    cells += [ts("a"), ts("b"), ts("c"), fmt(ratio, 2)]
    cells += [per_floor("a"), per_floor("b"), per_floor("c"), peaks]
    cells += [fmt(errs["b"], 4), fmt(errs["a"], 4)]
    return cells, {"key": ekey, "floor_ms": floor, "a_ms": t("a"), "b_ms": t("b"),
                   "c_ms": t("c"), "c_over_b": ratio, "rel_err_c_vs_b": errs["b"],
                   "rel_err_c_vs_a": errs["a"]}  # fmt: skip


def split_table(v: dict, lines: list[str]) -> None:
    splits = [(x, r) for x in "bc" for r in (v[x] or {}).get("runs", []) if "split" in r]
    if not splits:
        return
    lines.append("\nKernel time by category, one call (ms; torch.profiler):\n")
    cats = ("dequant", "attention", "gemm", "merge", "copy", "other")
    rows = [[x, r["mode"], r["cached"], r["q"], *(fmt(r["split"]["ms_by_category"].get(n), 3)
                                                  for n in cats)] for x, r in splits]  # fmt: skip
    lines += md_table(["variant", "mode", "cached", "q", *cats], rows)


def tests(work: Path, lines: list[str]) -> dict:
    """One row per pytest run (run.sh lists them in WORK/suites, each with
    its junit file; an older run: those of WORK/rc that have one)."""
    res = {}
    lines.append("\n### Targeted tests on CUDA\n")
    rcs = {}
    if (work / "rc").exists():
        for ln in (work / "rc").read_text().splitlines():
            n, rc, secs = ln.split()
            rcs[n] = (int(rc), int(secs))
    if (work / "suites").exists():
        names = (work / "suites").read_text().split()
    else:
        names = [n for n in rcs if (work / f"junit_{n}.xml").exists()]
    rows = []
    for name in names:
        p = work / f"junit_{name}.xml"
        if not p.exists():
            rc = rcs.get(name, ("?",))[0]
            res[name] = {"status": f"no junit (rc {rc}, timeout if 124)"}
            rows.append([name, res[name]["status"], *[BLANK] * 5])
            continue
        c = res[name] = junit_counts(p)
        c["rc"], c["seconds"] = rcs.get(name, (None, None))
        fl = "<br>".join(x.replace("|", "/").replace("\n", " ")[:160] for x in c["failures"][:8])
        rows.append([name, *(c[n] for n in ("passed", "failed", "errors", "skipped", "seconds")), fl])
    header = ["suite (tree)", "passed", "failed", "errors", "skipped", "seconds"]
    lines += md_table([*header, "failures"], rows)
    return res


def junit_counts(p: Path) -> dict:
    """Passed, failed, errors and skipped of a junit file, with the failures'
    node ids and messages."""
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "gpu_marked": []}
    for tc in ET.parse(p).getroot().iter("testcase"):
        nid = f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"
        for kind, count, label in (("failure", "failed", ""), ("error", "errors", "ERROR ")):
            if tc.find(kind) is not None:
                c[count] += 1
                msg = (tc.find(kind).get("message") or "")[:200]
                c["failures"].append(f"{nid}: {label}{msg}")
                break
        else:
            c["skipped" if tc.find("skipped") is not None else "passed"] += 1
    return c


# --------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------


BUG_KEYS = ("Cannot copy between CPU and CUDA", "Workspace is locked",
            "TurboQuant KV cache is not supported")  # fmt: skip


def load_calls(results_dir: Path) -> tuple[list[dict], dict]:
    """Every job's result, and per call the first line of its setup log."""
    rows: list[dict] = []
    calls: dict = {}
    for f in sorted(results_dir.glob("*_results.json")):
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
    """The error's first line: the innermost one naming a bug, if any."""
    e = r.get("error") or {}
    first = e.get("first_line", "")
    for c in e.get("chain") or []:
        if any(k in c.get("first_line", "") for k in BUG_KEYS):
            return f"{c['type']}: {c['first_line']}"
    return f"{e.get('type', '')}: {first}" if e else ""


def cell(r: dict | None) -> str:
    """A job's outcome in a few words: serves, skipped, or where it failed."""
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
    where = {"init": "startup", "short": "short prompts", "long": "continuation request"}.get(ph, ph)
    line = err_line(r)
    return f"**{o}** at {where}: `{line[:140]}`" if line else f"**{o}**"


def doc(scn: str) -> str:
    return f"{scn}: {S.SCENARIOS[scn]['doc']}"


def table_outcomes(rows: list[dict]) -> str:
    engine = [r for r in rows if S.SCENARIOS.get(r["scenario"], {}).get("kind") == "engine"]
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
    return next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))


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
    return {"prompts": n, "identical": first_div.count(None), "first_divergence": first_div,
            "mean_abs_dlogprob": statistics.mean(dlp) if dlp else None,
            "max_abs_dlogprob": max(dlp) if dlp else None, "tokens_compared": len(dlp)}  # fmt: skip


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
            out.append([rel, var, label, f"{c['identical']}/{c['prompts']}", div_list(c),
                        c["tokens_compared"], fmt_f(c["mean_abs_dlogprob"], ".2e"),
                        fmt_f(c["max_abs_dlogprob"], ".2e")])  # fmt: skip
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
            out.append([r["release"], r["variant"], r["scenario"], cell(r), BLANK, BLANK])
            continue
        b1 = r["speed"]["bs1"]["best_tok_per_s"]
        b32 = r["speed"]["bs32"]["best_tok_per_s"]
        base = r["scenario"]
        for workaround in ("_graph", "_none", "_eager"):
            base = base.replace(workaround, "")
        g = ref.get((r["release"], base))
        rat = (f"{b1 / g['bs1']['best_tok_per_s']:.2f} / {b32 / g['bs32']['best_tok_per_s']:.2f}"
               if g else "")  # fmt: skip
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
        meta[v] = (r["release"], r["variant"], b.get("reserved"), b.get("device"),
                   r.get("real_flash_attn_varlen_func"))  # fmt: skip
        for x in b.get("runs", []):
            runs.setdefault(f"{x['preset']}/{x['cached']}/{x['q']}", {})[v] = x
    if not runs:
        return "(no benchmark results)"
    variants = "; ".join(f"({v}) {m[0]} {m[1]}, flash-attn {m[4]}" for v, m in sorted(meta.items()))
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
        lines.append(f"- goal (c) <= 0.67 x (b) at 32K-128K: max (c)/(b) = {max(worst):.2f} "
                     f"-> {'met' if max(worst) <= 0.67 else 'missed'}")  # fmt: skip
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
    peaks = " / ".join(f"{d[v].get('peak_extra_bytes', 0) / MiB:.0f}" if d.get(v) else ""
                       for v in "abc")  # fmt: skip
    row = [preset.replace("turboquant_", ""), f"{int(cached) // 1024}K", q]
    row += [f"{fl:.3f}", fmt_f(a), fmt_f(b), fmt_f(c)]
    row += ["" if cb is None else f"**{cb:.2f}**"]
    row += ["" if c is None else f"{c / fl:.1f}", peaks]
    return row, cb


def lp_diff(a: list, b: list) -> tuple[float | None, float | None, int]:
    """Mean and max |a - b| over the positions both have."""
    d = [abs(x - y) for x, y in zip(a or [], b or []) if x is not None and y is not None]
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
    cached = "/".join(f"{x.get('num_cached_tokens')}:{y.get('num_cached_tokens')}"
                      for x, y in zip(xs, ys))  # fmt: skip
    return {**c, "plp_mean": statistics.mean(means) if means else None,
            "plp_max": max(maxes) if maxes else None, "plp_n": sum(n for *_, n in plp),
            "cached": cached}  # fmt: skip


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
            plp = f"{fmt_f(c['plp_mean'], '.2e')} / {fmt_f(c['plp_max'], '.2e')} ({c['plp_n']})"
            out.append([rel, var, label, c["cached"], f"{c['identical']}/{c['prompts']}",
                        div_list(c), plp, fmt_f(c["mean_abs_dlogprob"], ".2e")])  # fmt: skip
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
    gap = f"{mine - other:.3f}" if other is not None else f">{mine - min(d.values()):.2f}"
    return f"{j} ({gap})"


def spec_accept(r: dict) -> str:
    """Accepted / proposed draft tokens over the batch-1 runs (counter deltas)."""
    c = r.get("spec_counters") or {}
    s0, s1 = c.get("start") or {}, c.get("bs1") or {}

    def delta(part: str) -> float | None:
        ks = [k for k in s1 if part in k and "per_pos" not in k and isinstance(s1[k], (int, float))]
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
        cb = compare({"short": ref["spec_batch"]["outputs"]}, {"short": r["spec_batch"]["outputs"]})
        gaps = ", ".join(div_gap(x, y) for x, y in zip(ref["spec_bs1"], r["spec_bs1"]))
        speeds = " / ".join(str(v) for v in (r.get("eq_speed") or {}).values())
        same_w = r.get("weights_digest") == ref.get("weights_digest")
        lp = f"{fmt_f(c['mean_abs_dlogprob'], '.2e')} / {fmt_f(c['max_abs_dlogprob'], '.2e')}"
        out.append([rel, var, doc(scn) + ("" if same_w else " **weights differ**"),
                    f"{c['identical']}/{c['prompts']}", gaps, lp,
                    f"{cb['identical']}/{cb['prompts']}", spec_accept(r), speeds])  # fmt: skip
    header = ["release", "variant", "scenario", "identical / prompts (batch 1)"]
    header += ["first divergence per prompt (ref logprob gap there)"]
    header += ["chosen-token logprob mean / max abs d (agreed prefix)"]
    header += ["batch of 4: identical", "acceptance (batch 1)", "tok/s batch 1 / 4"]
    return "\n".join(md_table(header, out))


def table_spec_speed(rows: list[dict]) -> str:
    """The timed sdx_* runs (alone on the GPU): the fix against the
    workarounds, as ratios to the patched full-graph async run."""
    sx = [r for r in rows if r["scenario"].startswith("sdx_") and r.get("eq_speed")]
    base = {r["release"]: r["eq_speed"] for r in sx
            if r["scenario"] == "sdx_fa" and r["variant"] == "patched"}  # fmt: skip
    out = []
    for r in sorted(sx, key=lambda r: (r["release"], r["scenario"])):
        b1, b4 = r["eq_speed"].get("bs1_tok_per_s"), r["eq_speed"].get("bs4_tok_per_s")
        g = base.get(r["release"])
        rat = f"{g['bs1_tok_per_s'] / b1:.2f} / {g['bs4_tok_per_s'] / b4:.2f}" if g and b1 and b4 else ""
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


def sections(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """Each table of the engine's results under its heading."""
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
    return [
        ("1. Outcomes (unpatched release wheels vs patched)", [table_outcomes(rows)]),
        ("2. GPU memory after each continuation request", [table_memory(rows)]),
        ("3. Output equality (greedy token ids, 8 prompts x 32 tokens)",
         [table_pairs(rows, EQ_PAIRS, "pair"), table_variants_equal(rows)]),
        ("4. TurboQuant vs kv_cache_dtype auto (same dummy model, CUDA graphs)",
         [table_pairs(rows, AUTO_PAIRS, "pair")]),
        ("5. Decode throughput (short prompts: 32 tokens in, 256 out)", [table_speed(rows)]),
        ("6. Continuation prefill on the wheels' flash-attn (tq_continuation_bench shapes)",
         [table_bench(rows)]),
        ("7. Prefix-cache hit batched with a longer fresh prompt (vllm#46460)",
         [pfx, table_pfx(rows)]),
        ("8. Speculative decoding vs none (same tree; ngram, 3 draft tokens)",
         [spec, table_spec(rows), table_spec_speed(rows)]),
    ]  # fmt: skip


def empty(block: str) -> bool:
    """A table without rows (its header and separator only) or none."""
    return block.startswith(("|", "(no ")) and block.count("\n") < 2


def report(rows: list[dict], calls: dict) -> str:
    """tables.md: the device, dates and calls, then every table with rows
    under its heading."""
    gpus = sorted({r.get("gpu") for r in rows if r.get("gpu")})
    dates = sorted({r.get("started", "")[:10] for r in rows if r.get("started")})
    out = [
        "# The release wheels' engine (generated by ci/gpu/summarize.py --engine)",
        "",
        f"Device: {', '.join(gpus) or '?'}; dates: {', '.join(dates) or '?'}.",
        "Calls (each `CALL=NAME bash ci/gpu/run.sh engine`; README.md says what each ran):",
        *[f"- {c}: {v['header']} ({v['n']} jobs)" for c, v in sorted(calls.items())],
        "",
    ]
    for title, blocks in sections(rows):
        tables = [b for b in blocks if b.startswith(("|", "(no ", "variants"))]
        if all(empty(b) for b in tables):
            continue
        out += [f"## {title}", ""]
        for b in blocks:
            out += [b, ""]
    return "\n".join(out)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def kernel_level(work: Path, out: Path) -> str:
    """run.sh's work folder: the JSONs and tables.md into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def dump(name: str, data) -> None:
        (out / name).write_text(json.dumps(data, indent=1, default=str))

    dump("tq_cudagraph.json", cudagraph(work, lines))
    dump("tq_continuation_bench.json", bench(work, lines))
    if (work / "cg33_base.json").exists() or (work / "bench33_c.json").exists():
        title = "tq-v0.33 on v0.33.0 (base: b, patched: c)"
        dump("tq33.json", {"cudagraph": cudagraph(work, lines, "cg33", title),
                           "bench": bench(work, lines, "bench33", title)})  # fmt: skip
    t = tests(work, lines)
    nr = (work / "not_run").read_text().split() if (work / "not_run").exists() else []
    if nr:
        lines.append(f"\nNot run (deadline): {', '.join(nr)}")
    (out / "tests.json").write_text(json.dumps({"suites": t, "not_run": nr}, indent=1))
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="run.sh's work folder")
    ap.add_argument("--engine", help="a folder of the engine part's CALL_results.json")
    ap.add_argument("--out", help="the output folder (--work), file (--engine)")
    ap.add_argument("--prev", default="", help="an earlier summary's OUT (--work)")
    a = ap.parse_args()
    if a.engine:
        rows, calls = load_calls(Path(a.engine))
        if not rows:
            print(f"no CALL_results.json in {a.engine}")
            return 1
        text = report(rows, calls)
        Path(a.out or Path(a.engine) / "tables.md").write_text(text)
    elif a.work and a.out:
        if a.prev:
            PREV["cg"] = load(Path(a.prev) / "tq_cudagraph.json") or {}
            PREV["bench"] = load(Path(a.prev) / "tq_continuation_bench.json") or {}
        text = kernel_level(Path(a.work), Path(a.out))
    else:
        ap.error("--work DIR --out OUT, or --engine DIR")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
