"""Run a list of scenarios on the device, each in its own process with a
timeout, several at once where they may share the GPU, and print a short
table at the end (device side; call.sh runs it after stage_setup.py).

    python3 ci/gpu/engine/driver.py --call c3 --deadline 480 --out $OUT
    python3 ci/gpu/engine/driver.py --jobs v0.20.2:unpatched:m4,v0.20.2:patched:m4 ...

Jobs come from campaign.py (CALLS[call]["jobs"]) or --jobs, as
RELEASE:VARIANT:SCENARIO. The tree of a job is ROOT/rel/RELEASE (unpatched)
or ROOT/rel/RELEASE+VARIANT, made by stage_setup.py; a job whose tree is not
complete is recorded as skipped. Scheduling:
  - at most --parallel jobs at once;
  - a scenario marked exclusive (throughput, kernel benchmark) waits until
    nothing else runs and runs alone;
  - at most one job using gpu_memory_utilization at a time (vLLM's memory
    profile reads device-wide free memory, so another job's allocations
    during its profile shrink its KV budget);
  - an "import" job that fails makes the later jobs of that tree skip;
  - every job gets min(its timeout, what is left of --deadline - 15 s).
After every job, $OUT/<call>_results.json, <call>_table.md and
<call>_logs.tar.gz are rewritten, so a call killed midway keeps what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import campaign  # noqa: E402
import scenarios as S  # noqa: E402

ROOT = Path(os.environ.get("ENG_ROOT", "/root/eng"))


def tree_of(rel: str, var: str) -> Path:
    return ROOT / "rel" / (rel if var == "unpatched" else f"{rel}+{var}")


def uses_gmu(scn: str) -> bool:
    """Sizes its KV cache from the memory profile (gpu_memory_utilization)."""
    s = S.SCENARIOS[scn]
    return s["kind"] == "engine" and "kv_cache_memory_bytes" not in S.engine_kwargs(scn)


def short(res: dict) -> str:
    o = res.get("outcome", "?")
    e = res.get("error") or {}
    if e:
        first = e.get("first_line", "")
        chain = e.get("chain") or []
        # prefer the innermost message naming the bug
        for c in chain:
            if any(k in c.get("first_line", "") for k in ("Cannot copy", "Workspace is locked", "TurboQuant KV cache is not supported")):
                first = c["first_line"]
                break
        return f"{o}: {e.get('type', '')}: {first[:160]}"
    extra = ""
    if res.get("trials") or res.get("spec_bs1"):
        extra = eq_short(res)
    elif res.get("speed"):
        sp = res["speed"]
        extra = " ".join(f"{k} {v['best_tok_per_s']} tok/s" for k, v in sp.items())
    elif res.get("long"):
        mem = [r.get("mem", {}) for r in res["long"] if r.get("mem")]
        if mem:
            extra = "alloc MiB " + "/".join(str(round(m["allocated"] / 2**20)) for m in mem)
            ws = mem[-1].get("workspace_bytes")
            if isinstance(ws, int):
                extra += f" ws {ws / 2**20:.1f} MiB"
            tq = mem[-1].get("tq_layer_tensor_bytes")
            if tq:
                extra += f" tq-layer-bufs {tq / 2**20:.0f} MiB"
    elif res.get("bench"):
        extra = f"{len(res['bench'].get('runs', []))} rows"
    return f"{o} {extra}".strip()


def eq_short(res: dict) -> str:
    """pfx: H batched == H alone per trial; sd: tok/s and acceptance."""
    if res.get("trials"):
        same = sum(t["batched"]["token_ids"] == t["alone"]["token_ids"] for t in res["trials"])
        return f"H batched == alone: {same}/{len(res['trials'])} trials"
    c = res.get("spec_counters", {}).get("bs1", {})
    acc = [v for k, v in c.items() if k.endswith("num_accepted_tokens") and isinstance(v, float)]
    drafts = [v for k, v in c.items() if k.endswith("num_draft_tokens") and isinstance(v, float)]
    rate = f" accepted {acc[0]:.0f}/{drafts[0]:.0f} (cumulative)" if acc and drafts else ""
    return f"{res.get('eq_speed', {})}{rate}"


def table(results: list[dict]) -> str:
    lines = ["| release | variant | scenario | outcome | s |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.get('release')} | {r.get('variant')} | {r.get('scenario')} | "
                     f"{short(r).replace('|', '/')} | {r.get('wall_s', '')} |")
    return "\n".join(lines) + "\n"


def save(out: Path, call: str, results: list[dict], work: Path) -> None:
    tmp = out / f".{call}_results.json"
    tmp.write_text(json.dumps({"call": call, "results": results}, indent=1, default=str))
    tmp.replace(out / f"{call}_results.json")
    (out / f"{call}_table.md").write_text(table(results))
    tp = out / f".{call}_logs.tar.gz"
    with tarfile.open(tp, "w:gz") as tf:
        for f in sorted(work.glob("*")):
            if f.suffix in (".log", ".json") and f.stat().st_size < 8 << 20:
                tf.add(f, arcname=f"{call}/{f.name}")
    tp.replace(out / f"{call}_logs.tar.gz")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--call", default="adhoc")
    ap.add_argument("--jobs", default="")
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--parallel", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    a = ap.parse_args()
    t_start = time.time()
    deadline = t_start + a.deadline - 15
    plan = campaign.CALLS.get(a.call, {})
    jobs = [j for j in (a.jobs.split(",") if a.jobs else plan.get("jobs", [])) if j]
    parallel = a.parallel or plan.get("parallel", 4)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = ROOT / "work" / a.call
    work.mkdir(parents=True, exist_ok=True)
    print(f"[driver] {a.call}: {len(jobs)} jobs, parallel {parallel}, deadline {a.deadline:.0f} s", flush=True)
    results: list[dict] = []
    running: dict[str, dict] = {}
    failed_import: set[tuple[str, str]] = set()
    queue = list(jobs)

    def finish(key: str, info: dict, status: str | None = None) -> None:
        p = info["proc"]
        try:  # the job's process group: an engine-core child or compile workers left behind
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        jf = info["json"]
        res: dict = {}
        if jf.exists():
            try:
                res = json.loads(jf.read_text())
            except Exception as e:  # noqa: BLE001
                res = {"outcome": "error", "error": {"type": "BadJSON", "first_line": repr(e)}}
        rel, var, scn = key.split(":")
        res.update(release=rel, variant=var, scenario=scn)
        res["wall_s"] = round(time.time() - info["t0"], 1)
        res["rc"] = p.returncode
        if status:
            res["outcome"] = status
        elif p.returncode == 124 or p.returncode == -9:
            res["outcome"] = "timeout" if res.get("outcome") in (None, "incomplete") else res["outcome"]
        elif res.get("outcome") in (None, "incomplete"):
            res["outcome"] = f"crashed (rc {p.returncode})"
        if res["outcome"] not in ("ok",) and not res.get("error"):
            log = info["log"].read_text(errors="replace") if info["log"].exists() else ""
            tail = [ln for ln in log.splitlines() if ln.strip()][-12:]
            res["error"] = {"type": "log", "first_line": (tail[-1] if tail else "")[:300],
                            "log_tail": "\n".join(tail)[-3000:]}
        if scn == "import" and res["outcome"] != "ok":
            failed_import.add((rel, var))
        results.append(res)
        print(f"[driver] t={time.time() - t_start:5.0f}s done {key}: {short(res)} ({res['wall_s']} s)", flush=True)
        save(out, a.call, results, work)

    def start(key: str) -> None:
        rel, var, scn = key.split(":")
        s = S.SCENARIOS[scn]
        tree = tree_of(rel, var)
        left = deadline - time.time()
        to = int(min(s["timeout"], left))
        jf = work / f"{rel}_{var}_{scn}.json"
        log = work / f"{rel}_{var}_{scn}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = f"{tree}:{ROOT / 'deps'}"
        # vLLM's compile cache per job (jobs of one config must not write one
        # directory at once); Inductor's and Triton's caches stay shared
        env["VLLM_CACHE_ROOT"] = str(ROOT / "cache" / "vllm" / f"{rel}_{var}_{scn}")
        cmd = ["timeout", "-k", "10", str(to), sys.executable, str(HERE / "scenario.py"),
               "--scenario", scn, "--release", rel, "--variant", var, "--tree", str(tree), "--json", str(jf)]
        with open(log, "w") as lf:
            p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        running[key] = {"proc": p, "t0": time.time(), "json": jf, "log": log, "gmu": uses_gmu(scn) if s["kind"] == "engine" else False,
                        "exclusive": s["exclusive"]}
        print(f"[driver] t={time.time() - t_start:5.0f}s start {key} (timeout {to} s)", flush=True)

    def skip(key: str, why: str) -> None:
        rel, var, scn = key.split(":")
        res = {"release": rel, "variant": var, "scenario": scn, "outcome": f"skipped: {why}"}
        results.append(res)
        print(f"[driver] skip {key}: {why}", flush=True)
        save(out, a.call, results, work)

    while queue or running:
        # reap
        for key in list(running):
            info = running[key]
            if info["proc"].poll() is not None:
                del running[key]
                finish(key, info)
        if time.time() > deadline:
            for key, info in list(running.items()):
                try:
                    os.killpg(info["proc"].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                info["proc"].wait()
                del running[key]
                finish(key, info, status="killed: call deadline")
            for key in queue:
                skip(key, "call deadline")
            queue = []
            break
        # start what may start
        while queue:
            key = queue[0]
            rel, var, scn = key.split(":")
            s = S.SCENARIOS[scn]
            tree = tree_of(rel, var)
            if not (tree / ".complete").exists():
                queue.pop(0)
                skip(key, f"tree {tree.name} not staged")
                continue
            if (rel, var) in failed_import and scn != "import":
                queue.pop(0)
                skip(key, "import check failed for this tree")
                continue
            if deadline - time.time() < 45:
                queue.pop(0)
                skip(key, "call deadline")
                continue
            excl_running = any(i["exclusive"] for i in running.values())
            if excl_running:
                break
            if s["exclusive"]:
                if running:
                    break
            elif len(running) >= parallel:
                break
            if s["kind"] == "engine" and uses_gmu(scn) and any(i["gmu"] for i in running.values()):
                # look further down the queue for a job that may start now
                nxt = next((q for q in queue[1:] if not S.SCENARIOS[q.split(":")[2]]["exclusive"]
                            and not (S.SCENARIOS[q.split(":")[2]]["kind"] == "engine" and uses_gmu(q.split(":")[2]))),
                           None)
                if nxt is None:
                    break
                queue.remove(nxt)
                start(nxt)
                continue
            queue.pop(0)
            start(key)
            if s["exclusive"]:
                break
        time.sleep(0.5)
    save(out, a.call, results, work)
    print(f"\n[driver] {a.call} finished in {time.time() - t_start:.0f} s\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
