"""Collect what ci/gpu/run.sh left in its work folder into the result JSONs
and markdown tables (printed, and written to OUT/tables.md).

    python ci/gpu/summarize.py --work /tmp/gpuwork --out $OUT

The tables are written with mdtable.py, as the engine campaign's are
(ci/gpu/engine/summarize.py).
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from mdtable import BLANK, fmt, md_table

MiB = 2**20
SUITES = (
    "tq_patched",
    "tq_base_regression",
    "dsv4_patched",
    "dsv4_base",
    "tq_fix",
    "tq33_patched",
    "tq33_base_regression",
    "uq33_patched",
)


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


def cudagraph(
    work: Path, lines: list[str], pre: str = "cg", title: str = "Issue 4"
) -> dict:
    base, pat = load(work / f"{pre}_base.json"), load(work / f"{pre}_patched.json")
    res = {"base": base, "patched": pat}
    if not base and not pat and not (work / "cg_fix.json").exists():
        lines.append(f"\n({title}: no cudagraph results)\n")
        return res
    sb, sp = (
        load_pt(work / f"{pre}_samples_base.pt"),
        load_pt(work / f"{pre}_samples_patched.pt"),
    )
    fx0 = load(work / "cg_fix.json")
    dev = (pat or base or fx0)["device"]
    lines.append(f"\n### {title}: CUDA-graph capture, syncs ({dev.get('device')})\n")
    rows, res["patched_vs_base_eager_rel_err"] = scenario_rows(base, pat, sb, sp)
    header = ["mode/scenario"]
    for side in ("base", "patched"):
        header += [
            f"{side} syncs/step",
            f"{side} sync 'error'",
            f"{side} capture",
            f"{side} replay == eager (max abs diff)",
        ]
    lines += md_table([*header, "patched vs base eager (rel)"], rows)
    fx = load(work / "cg_fix.json")
    if fx:
        res["fix"] = fx
        fix_capture_rows(fx, lines)
    timing_rows(base, pat, lines)
    return res


def fix_capture_rows(fx: dict, lines: list[str]) -> None:
    """The capture checks on a proposed tree (cg_fix.json)."""
    lines.append("\nProposed fallback tree (ci/gpu/proposed/), same checks:\n")
    rows = []
    for k, x in fx.get("scenarios", {}).items():
        rp = x.get("replay") or {}
        sy = x.get("sync", {})
        rows.append(
            [
                k,
                sy.get("syncs_per_step", "-"),
                sy.get("error_mode", "-")[:60],
                x.get("capture", x.get("error", "-"))[:80],
                ("yes" if rp.get("ok") else "NO") if rp else "-",
            ]
        )
    header = ["mode/scenario", "syncs/step", "sync 'error'", "capture"]
    lines += md_table([*header, "replay == eager"], rows)
    for k, x in fx.get("timing", {}).items():
        lines.append(
            f"\nfix {k}: eager wall/step {fmt(x.get('eager_wall_ms_per_step'), 3)} ms, "
            f"graph replay wall/step {fmt(x.get('graph_wall_ms_per_step'), 3)} ms"
        )


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
    diffs = ", ".join(
        f"{o['max_abs_diff']:.2g}" + (" bit-exact" if o["bit_exact"] else "")
        for o in rp["replays"]
    )
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
    keys = list(
        ((pat or {}).get("scenarios") or (base or {}).get("scenarios") or {}).keys()
    )
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
            row += [
                sy.get("syncs_per_step", "-"),
                sy.get("error_mode", "-")[:70],
                capture_cell(x),
                replay_cell(x),
            ]
        rows.append([*row, fmt(r, 4)])
    return rows, cross


def timing_rows(base, pat, lines: list[str]) -> None:
    lines.append(
        "\nPrefill step, batch of 8 continuation requests over 4096 cached "
        "tokens each (store + forward), ms:\n"
    )
    rows = []
    for k in (pat or {}).get("timing") or (base or {}).get("timing") or {}:
        b = (base or {}).get("timing", {}).get(k, {})
        p = (pat or {}).get("timing", {}).get(k, {})
        bw, pw = b.get("eager_wall_ms_per_step"), p.get("eager_wall_ms_per_step")
        rows.append(
            [
                k,
                fmt(bw, 3),
                fmt(pw, 3),
                fmt(pw / bw if bw and pw else None, 2),
                fmt(b.get("eager_gpu_ms_per_step"), 3),
                fmt(p.get("eager_gpu_ms_per_step"), 3),
                fmt(p.get("graph_wall_ms_per_step"), 3),
                b.get("sync", {}).get("syncs_per_step", "-"),
            ]
        )
    header = ["mode/batch", "base wall/step", "patched wall/step", "patched/base"]
    header += ["base GPU/step", "patched GPU/step", "patched graph replay wall/step"]
    lines += md_table([*header, "base syncs/step"], rows)


def bench(
    work: Path, lines: list[str], pre: str = "bench", title: str = "Issue 3"
) -> dict:
    """The continuation bench's tables: reserved memory, time per call,
    kernel split, a proposed change (bench_f), the stand-in's check."""
    v = {x: load(work / f"{pre}_{x}.json") for x in "abc"}
    s = {x: load_pt(work / f"samples_{x}.pt") for x in "abc"}
    res: dict = {"variants": v, "rows": [], "targets": {}}
    if not any(v.values()):
        lines.append(f"\n({title}: no bench results)\n")
        return res
    anyv = next(x for x in v.values() if x)
    ceil = anyv["ceilings"]
    lines.append(
        f"\n### {title}: continuation prefill ({anyv['device'].get('device')})\n"
    )
    lines.append(
        f"Ceilings measured in the run: copy "
        f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s. "
        f"Shapes {anyv['shape']}."
    )
    reserved_table(v, lines, res)
    by = {
        x: {
            (r["preset"], r["mode"], r["cached"], r["q"]): r
            for r in (v[x] or {}).get("runs", [])
        }
        for x in "abc"
    }
    time_table(by, s, lines, res)
    split_table(v, lines)
    f = load(work / "bench_f.json")
    if f:
        fix_table(f, load_pt(work / "samples_f.pt"), by, s, lines, res)
    c = v["c"] or {}
    if "shim_check" in c:
        lines.append(
            "\nFA2 stand-in vs the float64 reference (rel err of out, max abs err "
            "of LSE): " + json.dumps(c["shim_check"])
        )
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
        rows.append(
            [
                mml,
                f"{fmt(a / MiB if a else None, 0)} per layer",
                fmt(b / MiB if b else None, 0),
                fmt(c / MiB if c else None, 0),
                fmt(c / b if b and c else None, 4),
            ]
        )
    header = ["max_model_len", "(a) v0.20.2 per-layer buffers"]
    header += ["(b) v0.21.0 + v0.24.0 reservation", "(c) patched", "(c)/(b)"]
    lines += md_table(header, rows)
    cr = [rsv[m]["c"] for m in rsv]
    res["targets"]["reserved_independent_of_max_model_len"] = bool(
        cr[0] and cr[0] == cr[1]
    )
    b128, c128 = rsv[mmls[0]]["b"], rsv[mmls[0]]["c"]
    res["targets"]["reserved_c_le_b_over_8_at_128K"] = bool(
        b128 and c128 and c128 <= b128 / 8
    )
    res["reserved"] = rsv


def time_table(by: dict, s: dict, lines: list[str], res: dict) -> None:
    keys = list(dict.fromkeys(k for x in "cba" for k in by[x]))
    lines.append(
        "\nTime per call (median, ms), measured/floor, extra peak memory during "
        "the call (MiB):\n"
    )
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
        res["targets"][f"time_c_le_1.10_b_32K_128K_{mode}"] = {
            "max_ratio": w,
            "met": w <= 1.10,
        }
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
    prev = next(
        (x for x in PREV.get("bench", {}).get("rows", []) if x["key"] == ekey), {}
    )
    errs = {}
    for x in "ba":
        e = rel(s["c"].get(ekey) if s["c"] else None, s[x].get(ekey) if s[x] else None)
        errs[x] = e if e is not None else prev.get(f"rel_err_c_vs_{x}")
    peaks = "/".join(
        fmt(rows[x].get("peak_extra_bytes", 0) / MiB, 0)
        if rows[x] and "peak_extra_bytes" in rows[x]
        else "-"
        for x in "abc"
    )
    cells = [k[0].replace("turboquant_", ""), *k[1:], fmt(floor, 3)]
    cells += [ts("a"), ts("b"), ts("c"), fmt(ratio, 2)]
    cells += [per_floor("a"), per_floor("b"), per_floor("c"), peaks]
    cells += [fmt(errs["b"], 4), fmt(errs["a"], 4)]
    return cells, {
        "key": ekey,
        "floor_ms": floor,
        "a_ms": t("a"),
        "b_ms": t("b"),
        "c_ms": t("c"),
        "c_over_b": ratio,
        "rel_err_c_vs_b": errs["b"],
        "rel_err_c_vs_a": errs["a"],
    }


def split_table(v: dict, lines: list[str]) -> None:
    splits = [
        (x, r) for x in "bc" for r in (v[x] or {}).get("runs", []) if "split" in r
    ]
    if not splits:
        return
    lines.append("\nKernel time by category, one call (ms; torch.profiler):\n")
    cats = ("dequant", "attention", "gemm", "merge", "copy", "other")
    rows = [
        [x, r["mode"], r["cached"], r["q"]]
        + [fmt(r["split"]["ms_by_category"].get(n), 3) for n in cats]
        for x, r in splits
    ]
    lines += md_table(["variant", "mode", "cached", "q", *cats], rows)


def fix_table(f: dict, sf, by: dict, s: dict, lines: list[str], res: dict) -> None:
    """A proposed change (ci/gpu/proposed/, run as variant f) against (b)."""
    byf = {(r["preset"], r["mode"], r["cached"], r["q"]): r for r in f.get("runs", [])}
    lines.append(
        "\n(c') proposed fallback (ci/gpu/proposed/) vs (b), same run, mode sdpa "
        "(no vLLM flash-attn):\n"
    )
    wf = 0.0
    res["fix"] = {"variant": f, "rows": []}
    rows = []

    def ms(x):
        return (x or {}).get("time", {}).get("median_ms")

    for k, r in byf.items():
        tb, tc, tf = ms(by["b"].get(k)), ms(by["c"].get(k)), ms(r)
        ekey = "/".join(map(str, k))
        e = rel(sf.get(ekey) if sf else None, s["b"].get(ekey) if s["b"] else None)
        ratio = tf / tb if tf and tb else None
        if k[2] >= 32768 and ratio:
            wf = max(wf, ratio)
        fl = r["floor"]["floor_ms"]
        rows.append(
            [k[0].replace("turboquant_", ""), k[2], k[3]]
            + [fmt(tb, 3), fmt(tc, 3), fmt(tf, 3), fmt(ratio, 2)]
            + [fmt(tf / fl if tf else None, 1)]
            + [fmt(r.get("peak_extra_bytes", 0) / MiB, 0), fmt(e, 4)]
        )
        res["fix"]["rows"].append(
            {
                "key": ekey,
                "b_ms": tb,
                "c_ms": tc,
                "fix_ms": tf,
                "fix_over_b": ratio,
                "rel_err_fix_vs_b": e,
            }
        )
    header = ["preset", "cached", "q", "(b) ms", "(c) ms", "(c') ms", "(c')/(b)"]
    header += ["(c')/floor", "peak+ c' MiB", "rel err c' vs b"]
    lines += md_table(header, rows)
    target = {"max_ratio": wf, "met": 0 < wf <= 1.10}
    res["targets"]["fix_time_le_1.10_b_32K_128K_sdpa"] = target
    lines.append("\nFix target: " + json.dumps(target))


def tests(work: Path, lines: list[str]) -> dict:
    res = {}
    lines.append("\n### Targeted tests on CUDA\n")
    rcs = {}
    if (work / "rc").exists():
        for ln in (work / "rc").read_text().splitlines():
            n, rc, s = ln.split()
            rcs[n] = (int(rc), int(s))
    rows = []
    for name in SUITES:
        p = work / f"junit_{name}.xml"
        if not p.exists() and name.startswith(("tq33", "uq33")) and name not in rcs:
            continue  # the newest or the uq part was not asked for
        if not p.exists():
            status = (
                "not run"
                if name not in rcs
                else f"no junit (rc {rcs[name][0]}, timeout if 124)"
            )
            rows.append([name, status, *[BLANK] * 5])
            res[name] = {"status": status}
            continue
        c = junit_counts(p)
        c["rc"], c["seconds"] = rcs.get(name, (None, None))
        res[name] = c
        fl = "<br>".join(
            x.replace("|", "/").replace("\n", " ")[:160] for x in c["failures"][:8]
        )
        counts = [c[n] for n in ("passed", "failed", "errors", "skipped", "seconds")]
        rows.append([name, *counts, fl])
    header = ["suite (tree)", "passed", "failed", "errors", "skipped", "seconds"]
    lines += md_table([*header, "failures"], rows)
    return res


def junit_counts(p: Path) -> dict:
    """Passed, failed, errors and skipped of a junit file, with the failures'
    node ids and messages."""
    c = {
        "passed": 0,
        "failed": 0,
        "errors": 0,
        "skipped": 0,
        "failures": [],
        "gpu_marked": [],
    }
    for tc in ET.parse(p).getroot().iter("testcase"):
        nid = f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"
        if tc.find("failure") is not None:
            c["failed"] += 1
            msg = (tc.find("failure").get("message") or "")[:200]
            c["failures"].append(f"{nid}: {msg}")
        elif tc.find("error") is not None:
            c["errors"] += 1
            msg = (tc.find("error").get("message") or "")[:200]
            c["failures"].append(f"{nid}: ERROR {msg}")
        elif tc.find("skipped") is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prev", default="", help="earlier summary's OUT (cross-checks)")
    args = ap.parse_args()
    if args.prev:
        PREV["cg"] = load(Path(args.prev) / "tq_cudagraph.json") or {}
        PREV["bench"] = load(Path(args.prev) / "tq_continuation_bench.json") or {}
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    cg = cudagraph(work, lines)
    (out / "tq_cudagraph.json").write_text(json.dumps(cg, indent=1, default=str))
    b = bench(work, lines)
    (out / "tq_continuation_bench.json").write_text(
        json.dumps(b, indent=1, default=str)
    )
    if (work / "cg33_base.json").exists() or (work / "bench33_c.json").exists():
        title = "tq-v0.33 on v0.33.0 (base: b, patched: c)"
        newest = {
            "cudagraph": cudagraph(work, lines, "cg33", title),
            "bench": bench(work, lines, "bench33", title),
        }
        (out / "tq33.json").write_text(json.dumps(newest, indent=1, default=str))
    t = tests(work, lines)
    nr = (work / "not_run").read_text().split() if (work / "not_run").exists() else []
    if nr:
        lines.append(f"\nNot run (deadline): {', '.join(nr)}")
    (out / "tests.json").write_text(json.dumps({"suites": t, "not_run": nr}, indent=1))
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
