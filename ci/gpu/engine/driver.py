"""Run one call's engine jobs on the device, each scenario.py in its own
process with a timeout, several at once where they may share the GPU (run.sh's
engine part runs it after setup.py):

    python3 ci/gpu/engine/driver.py --call crashes --deadline 400 --out $OUT
    python3 ci/gpu/engine/driver.py --jobs v0.20.2:unpatched:m4,v0.20.2:patched:m4 ...

Jobs come from scenarios.CALLS[call] or --jobs, as RELEASE:VARIANT:SCENARIO;
a job's tree is ROOT/rel/RELEASE (unpatched) or ROOT/rel/RELEASE+VARIANT, and
a job whose tree setup.py has not completed is recorded as skipped.
Scheduling: at most --parallel jobs at once; an exclusive scenario (timed)
runs alone; at most one job sizing its KV cache from the memory profile
(gpu_memory_utilization: vLLM's profile reads device-wide free memory) at a
time; every job gets min(its timeout, what is left of --deadline - 15 s), and
no job starts in the last 45 s. After every job $OUT/CALL_results.json,
CALL_table.md and CALL_logs.tar.gz are rewritten, so a call cut short keeps
what it has.
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
sys.path[:0] = [str(HERE), str(HERE.parent)]
import scenarios as S  # noqa: E402
import summarize  # noqa: E402

ROOT = Path(os.environ.get("ENG_ROOT", "/root/eng"))


def tree_of(rel: str, var: str) -> Path:
    return ROOT / "rel" / (rel if var == "unpatched" else f"{rel}+{var}")


def traits(job: str) -> tuple[bool, bool]:
    """(exclusive, sizes its KV cache from the memory profile)."""
    scn = job.split(":")[2]
    s = S.SCENARIOS[scn]
    gmu = s["kind"] == "engine" and "kv_cache_memory_bytes" not in S.engine_kwargs(scn)
    return s["exclusive"], gmu


def outcome(res: dict, rc: int | None, status: str | None) -> str:
    """The driver's own (a deadline), a timeout, a crash before the job
    wrote one, or what the job wrote."""
    mine = res.get("outcome") in (None, "incomplete")
    if status:
        return status
    if rc in (124, -9):
        return "timeout" if mine else res["outcome"]
    return f"crashed (rc {rc})" if mine else res["outcome"]


def log_error(log: Path) -> dict:
    """A failed job's error from the end of its log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = [ln for ln in text.splitlines() if ln.strip()][-12:]
    return {"type": "log", "first_line": (tail[-1] if tail else "")[:300],
            "log_tail": "\n".join(tail)[-3000:]}  # fmt: skip


class Call:
    """One call's jobs: those queued, those running, the results so far."""

    def __init__(self, name: str, jobs: list[str], parallel: int, deadline: float, out: Path):
        self.name, self.queue, self.parallel, self.deadline = name, jobs, parallel, deadline
        self.out, self.work = out, ROOT / "work" / name
        self.results: list[dict] = []
        self.running: dict[str, dict] = {}
        self.t0 = time.time()
        out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        """Start jobs as they may start, until none is left or the deadline."""
        while self.queue or self.running:
            for job in [j for j, i in self.running.items() if i["proc"].poll() is not None]:
                self.finish(job, self.running.pop(job))
            if time.time() > self.deadline:
                for job, info in list(self.running.items()):
                    self.finish(job, self.running.pop(job), "killed: call deadline")
                for job in self.queue:
                    self.record(job, {"outcome": "skipped: call deadline"})
                self.queue = []
            self.start_ready()
            time.sleep(0.5)
        self.save()

    def next_job(self) -> str | None:
        """The queue's head if it may start now; when only the memory
        profile (another job sizing its KV cache from it) holds the head
        back, the first later job that is neither exclusive nor sized so."""
        head = self.queue[0]
        exclusive, gmu = traits(head)
        busy = [traits(j) for j in self.running]
        if any(e for e, _ in busy) or (exclusive and busy) or len(busy) >= self.parallel:
            return None
        if gmu and any(g for _, g in busy):
            return next((q for q in self.queue[1:] if traits(q) == (False, False)), None)
        return head

    def start_ready(self) -> None:
        """Start the queued jobs that may start now, in order; skip those
        whose tree is not staged, and all in the call's last 45 s."""
        while self.queue:
            rel, var, _ = self.queue[0].split(":")
            why = None if (tree_of(rel, var) / ".complete").exists() else (
                f"tree {tree_of(rel, var).name} not staged")
            if self.deadline - time.time() < 45:
                why = "call deadline"
            if why:
                self.record(self.queue.pop(0), {"outcome": f"skipped: {why}"})
                continue
            job = self.next_job()
            if job is None:
                return
            self.queue.remove(job)
            self.start(job)
            if traits(job)[0]:
                return

    def start(self, job: str) -> None:
        rel, var, scn = job.split(":")
        tree, stem = tree_of(rel, var), f"{rel}_{var}_{scn}"
        timeout = int(min(S.SCENARIOS[scn]["timeout"], self.deadline - time.time()))
        env = dict(os.environ, PYTHONPATH=f"{tree}:{ROOT / 'deps'}",
                   # vLLM's compile cache per job; Inductor's and Triton's shared
                   VLLM_CACHE_ROOT=str(ROOT / "cache" / "vllm" / stem))  # fmt: skip
        cmd = ["timeout", "-k", "10", str(timeout), sys.executable, str(HERE / "scenario.py"),
               "--scenario", scn, "--release", rel, "--variant", var, "--tree", str(tree),
               "--json", str(self.work / f"{stem}.json")]  # fmt: skip
        with open(self.work / f"{stem}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
        self.running[job] = {"proc": proc, "t0": time.time(), "stem": stem}
        self.say(f"start {job} (timeout {timeout} s)")

    def finish(self, job: str, info: dict, status: str | None = None) -> None:
        proc = info["proc"]
        try:  # the job's process group: an engine-core child, compile workers
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        path = self.work / f"{info['stem']}.json"
        try:
            res = json.loads(path.read_text()) if path.exists() else {}
        except ValueError as e:
            res = {"error": {"type": "BadJSON", "first_line": repr(e)}}
        res.update(wall_s=round(time.time() - info["t0"], 1), rc=proc.returncode)
        res["outcome"] = outcome(res, proc.returncode, status)
        if res["outcome"] != "ok" and not res.get("error"):
            res["error"] = log_error(self.work / f"{info['stem']}.log")
        self.record(job, res)

    def record(self, job: str, res: dict) -> None:
        rel, var, scn = job.split(":")
        res.update(release=rel, variant=var, scenario=scn)
        self.results.append(res)
        self.say(f"done {job}: {summarize.cell(res)}")
        self.save()

    def table(self) -> str:
        rows = [[r["release"], r["variant"], r["scenario"],
                 summarize.cell(r).replace("|", "/"), r.get("wall_s", "")]
                for r in self.results]  # fmt: skip
        header = ["release", "variant", "scenario", "outcome", "s"]
        return "\n".join(summarize.md_table(header, rows)) + "\n"

    def save(self) -> None:
        """The results, the table and the jobs' logs and JSON, each
        replaced whole."""
        data = json.dumps({"call": self.name, "results": self.results}, indent=1, default=str)
        (self.out / f".{self.name}_results.json").write_text(data)
        (self.out / f".{self.name}_results.json").replace(self.out / f"{self.name}_results.json")
        (self.out / f"{self.name}_table.md").write_text(self.table())
        tmp = self.out / f".{self.name}_logs.tar.gz"
        with tarfile.open(tmp, "w:gz") as tf:
            for f in sorted(self.work.glob("*")):
                if f.suffix in (".log", ".json") and f.stat().st_size < 8 << 20:
                    tf.add(f, arcname=f"{self.name}/{f.name}")
        tmp.replace(self.out / f"{self.name}_logs.tar.gz")

    def say(self, msg: str) -> None:
        print(f"[driver] t={time.time() - self.t0:5.0f}s {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--call", default="adhoc")
    ap.add_argument("--jobs", default="", help="RELEASE:VARIANT:SCENARIO,...")
    ap.add_argument("--deadline", type=float, default=540, help="seconds from now")
    ap.add_argument("--parallel", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    a = ap.parse_args()
    parallel, _, jobs = S.CALLS.get(a.call, (4, 0, []))
    jobs = [j for j in a.jobs.split(",") if j] if a.jobs else list(jobs)
    call = Call(a.call, jobs, a.parallel or parallel, time.time() + a.deadline - 15, Path(a.out))
    call.say(f"{a.call}: {len(jobs)} jobs, {call.parallel} at once, deadline {a.deadline:.0f} s")
    call.run()
    print("\n" + call.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
