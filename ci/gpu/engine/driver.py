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
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import campaign  # noqa: E402
import scenarios as S  # noqa: E402
from mdtable import md_table  # noqa: E402

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
            if any(
                k in c.get("first_line", "")
                for k in (
                    "Cannot copy",
                    "Workspace is locked",
                    "TurboQuant KV cache is not supported",
                )
            ):
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
            extra = "alloc MiB " + "/".join(
                str(round(m["allocated"] / 2**20)) for m in mem
            )
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
        same = sum(
            t["batched"]["token_ids"] == t["alone"]["token_ids"] for t in res["trials"]
        )
        return f"H batched == alone: {same}/{len(res['trials'])} trials"
    c = res.get("spec_counters", {}).get("bs1", {})
    acc = [
        v
        for k, v in c.items()
        if k.endswith("num_accepted_tokens") and isinstance(v, float)
    ]
    drafts = [
        v
        for k, v in c.items()
        if k.endswith("num_draft_tokens") and isinstance(v, float)
    ]
    rate = (
        f" accepted {acc[0]:.0f}/{drafts[0]:.0f} (cumulative)" if acc and drafts else ""
    )
    return f"{res.get('eq_speed', {})}{rate}"


def table(results: list[dict]) -> str:
    rows = [
        [r.get("release"), r.get("variant"), r.get("scenario")]
        + [short(r).replace("|", "/"), r.get("wall_s", "")]
        for r in results
    ]
    header = ["release", "variant", "scenario", "outcome", "s"]
    return "\n".join(md_table(header, rows)) + "\n"


def save(out: Path, call: str, results: list[dict], work: Path) -> None:
    tmp = out / f".{call}_results.json"
    tmp.write_text(
        json.dumps({"call": call, "results": results}, indent=1, default=str)
    )
    tmp.replace(out / f"{call}_results.json")
    (out / f"{call}_table.md").write_text(table(results))
    tp = out / f".{call}_logs.tar.gz"
    with tarfile.open(tp, "w:gz") as tf:
        for f in sorted(work.glob("*")):
            if f.suffix in (".log", ".json") and f.stat().st_size < 8 << 20:
                tf.add(f, arcname=f"{call}/{f.name}")
    tp.replace(out / f"{call}_logs.tar.gz")


@dataclasses.dataclass
class Call:
    """One call's jobs: those queued, those running, the results so far."""

    name: str
    queue: list[str]
    parallel: int
    deadline: float  # running jobs are killed past it
    out: Path
    work: Path
    t_start: float
    results: list[dict] = dataclasses.field(default_factory=list)
    running: dict[str, dict] = dataclasses.field(default_factory=dict)
    failed_import: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    def run(self) -> None:
        """Start jobs as they may start, until none is left or the deadline."""
        while self.queue or self.running:
            self.reap()
            if time.time() > self.deadline:
                self.stop_at_deadline()
                break
            self.start_ready()
            time.sleep(0.5)
        save(self.out, self.name, self.results, self.work)

    def reap(self) -> None:
        for key in list(self.running):
            info = self.running[key]
            if info["proc"].poll() is not None:
                del self.running[key]
                self.finish(key, info)

    def stop_at_deadline(self) -> None:
        for key, info in list(self.running.items()):
            try:
                os.killpg(info["proc"].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            info["proc"].wait()
            del self.running[key]
            self.finish(key, info, status="killed: call deadline")
        for key in self.queue:
            self.skip(key, "call deadline")
        self.queue = []

    def start_ready(self) -> None:
        """Start the queued jobs that may start now, in order."""
        while self.queue:
            key = self.queue[0]
            scn = key.split(":")[2]
            s = S.SCENARIOS[scn]
            why = self.skip_reason(key)
            if why:
                self.queue.pop(0)
                self.skip(key, why)
                continue
            if not self.has_room(s):
                break
            if s["kind"] == "engine" and uses_gmu(scn) and self.gmu_running():
                # look further down the queue for a job that may start now
                nxt = self.next_without_gmu()
                if nxt is None:
                    break
                self.queue.remove(nxt)
                self.start(nxt)
                continue
            self.queue.pop(0)
            self.start(key)
            if s["exclusive"]:
                break

    def skip_reason(self, key: str) -> str | None:
        rel, var, scn = key.split(":")
        tree = tree_of(rel, var)
        if not (tree / ".complete").exists():
            return f"tree {tree.name} not staged"
        if (rel, var) in self.failed_import and scn != "import":
            return "import check failed for this tree"
        if self.deadline - time.time() < 45:
            return "call deadline"
        return None

    def has_room(self, s: dict) -> bool:
        """Exclusive jobs run alone; the others up to --parallel at once."""
        if any(i["exclusive"] for i in self.running.values()):
            return False
        if s["exclusive"]:
            return not self.running
        return len(self.running) < self.parallel

    def gmu_running(self) -> bool:
        return any(i["gmu"] for i in self.running.values())

    def next_without_gmu(self) -> str | None:
        """The first queued job after the head that is neither exclusive nor
        sized by the memory profile."""
        for q in self.queue[1:]:
            scn = q.split(":")[2]
            s = S.SCENARIOS[scn]
            if not s["exclusive"] and not (s["kind"] == "engine" and uses_gmu(scn)):
                return q
        return None

    def start(self, key: str) -> None:
        rel, var, scn = key.split(":")
        s = S.SCENARIOS[scn]
        tree = tree_of(rel, var)
        to = int(min(s["timeout"], self.deadline - time.time()))
        jf = self.work / f"{rel}_{var}_{scn}.json"
        log = self.work / f"{rel}_{var}_{scn}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = f"{tree}:{ROOT / 'deps'}"
        # vLLM's compile cache per job (jobs of one config must not write one
        # directory at once); Inductor's and Triton's caches stay shared
        env["VLLM_CACHE_ROOT"] = str(ROOT / "cache" / "vllm" / f"{rel}_{var}_{scn}")
        cmd = [
            "timeout",
            "-k",
            "10",
            str(to),
            sys.executable,
            str(HERE / "scenario.py"),
        ]
        cmd += ["--scenario", scn, "--release", rel, "--variant", var]
        cmd += ["--tree", str(tree), "--json", str(jf)]
        with open(log, "w") as lf:
            p = subprocess.Popen(
                cmd,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.running[key] = {
            "proc": p,
            "t0": time.time(),
            "json": jf,
            "log": log,
            "gmu": uses_gmu(scn) if s["kind"] == "engine" else False,
            "exclusive": s["exclusive"],
        }
        self.say(f"start {key} (timeout {to} s)")

    def finish(self, key: str, info: dict, status: str | None = None) -> None:
        p = info["proc"]
        try:  # the job's process group: an engine-core child or compile workers
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        res = read_result(info["json"])
        rel, var, scn = key.split(":")
        res.update(release=rel, variant=var, scenario=scn)
        res["wall_s"] = round(time.time() - info["t0"], 1)
        res["rc"] = p.returncode
        res["outcome"] = outcome(res, p.returncode, status)
        if res["outcome"] not in ("ok",) and not res.get("error"):
            res["error"] = log_error(info["log"])
        if scn == "import" and res["outcome"] != "ok":
            self.failed_import.add((rel, var))
        self.results.append(res)
        self.say(f"done {key}: {short(res)} ({res['wall_s']} s)")
        save(self.out, self.name, self.results, self.work)

    def skip(self, key: str, why: str) -> None:
        rel, var, scn = key.split(":")
        res = {"release": rel, "variant": var, "scenario": scn}
        self.results.append(res | {"outcome": f"skipped: {why}"})
        print(f"[driver] skip {key}: {why}", flush=True)
        save(self.out, self.name, self.results, self.work)

    def say(self, msg: str) -> None:
        print(f"[driver] t={time.time() - self.t_start:5.0f}s {msg}", flush=True)


def read_result(jf: Path) -> dict:
    """The job's JSON as scenario.py left it ({} if none)."""
    if not jf.exists():
        return {}
    try:
        return json.loads(jf.read_text())
    except Exception as e:  # noqa: BLE001
        return {"outcome": "error", "error": {"type": "BadJSON", "first_line": repr(e)}}


def outcome(res: dict, rc: int | None, status: str | None) -> str:
    """A job's outcome: the driver's own (a deadline), a timeout, a crash
    before the job wrote one, or what the job wrote."""
    if status:
        return status
    if rc == 124 or rc == -9:
        return (
            "timeout" if res.get("outcome") in (None, "incomplete") else res["outcome"]
        )
    if res.get("outcome") in (None, "incomplete"):
        return f"crashed (rc {rc})"
    return res["outcome"]


def log_error(log: Path) -> dict:
    """A failed job's error from the end of its log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = [ln for ln in text.splitlines() if ln.strip()][-12:]
    return {
        "type": "log",
        "first_line": (tail[-1] if tail else "")[:300],
        "log_tail": "\n".join(tail)[-3000:],
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--call", default="adhoc")
    ap.add_argument("--jobs", default="")
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--parallel", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    t_start = time.time()
    plan = campaign.CALLS.get(a.call, {})
    jobs = [j for j in (a.jobs.split(",") if a.jobs else plan.get("jobs", [])) if j]
    call = Call(
        name=a.call,
        queue=list(jobs),
        parallel=a.parallel or plan.get("parallel", 4),
        deadline=t_start + a.deadline - 15,
        out=Path(a.out),
        work=ROOT / "work" / a.call,
        t_start=t_start,
    )
    call.out.mkdir(parents=True, exist_ok=True)
    call.work.mkdir(parents=True, exist_ok=True)
    print(
        f"[driver] {a.call}: {len(jobs)} jobs, parallel {call.parallel}, "
        f"deadline {a.deadline:.0f} s",
        flush=True,
    )
    call.run()
    print(f"\n[driver] {a.call} finished in {time.time() - t_start:.0f} s\n")
    print(table(call.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
