"""The device campaign: which scenarios each call runs (driver.py reads
CALLS[call]; the campaign's plan, ci/gpu/results/history/engine/PLAN.md,
explains the order and the budget). A job is
RELEASE:VARIANT:SCENARIO. Order matters: the driver starts jobs in this
order (exclusive ones alone), and what the call's deadline cuts off is the
tail, so the most valuable jobs come first.
"""

from __future__ import annotations

R0, R1, R2, R3 = "v0.20.2", "v0.21.0", "v0.26.0", "v0.27.1"
U, P = "unpatched", "patched"


def jobs(*specs: str) -> list[str]:
    return [s for s in specs]


CALLS: dict[str, dict] = {
    # c1, c2: staging only (v0.20.2 arrives in three parts)
    "c1": {"parallel": 1, "jobs": []},
    "c2": {"parallel": 1, "jobs": []},
    # c3: v0.20.2 complete + the patched wheel's overlay, v0.21.0 complete.
    # The bugs on the unpatched release wheels and the patched wheel serving
    # the same scenarios (most valuable first), then output equality and
    # TurboQuant-vs-auto, then the rest of the scheduler matrix.
    "c3": {
        "parallel": 6,
        "jobs": jobs(
            f"{R0}:{U}:import",
            f"{R0}:{P}:import",
            f"{R1}:{U}:import",
            f"{R0}:{U}:m4",  # vllm#40807: startup fails in the CUDA-graph memory profile
            f"{R0}:{U}:h0",  # the hybrid gate: NotImplementedError
            f"{R0}:{U}:m1",  # serves; per-layer dequant buffers grow with the context
            f"{R1}:{U}:m1",  # vllm#41726: Workspace is locked ... _continuation_prefill
            f"{R1}:{U}:h1",  # the same on the model family (hybrid)
            f"{R0}:{P}:m4",
            f"{R0}:{P}:h1",
            f"{R0}:{P}:m1",
            f"{R0}:{P}:e_m1",  # graphs vs eager (dense)
            f"{R0}:{P}:e_h1",  # graphs vs eager (hybrid)
            f"{R0}:{P}:a_m1",  # TurboQuant vs auto (dense)
            f"{R0}:{P}:a_h1",  # TurboQuant vs auto (hybrid)
            f"{R0}:{U}:m2",
            f"{R0}:{P}:m2",
            f"{R0}:{U}:m3",
            f"{R0}:{P}:m3",
            f"{R0}:{U}:m5",
            f"{R0}:{P}:m5",
            f"{R0}:{P}:h4",
            f"{R1}:{U}:m2",
            f"{R1}:{U}:m4",
            f"{R1}:{U}:m5",
            f"{R1}:{U}:h4",
            f"{R0}:{U}:m6",
            f"{R0}:{P}:m6",
        ),
    },
    # c4: most of v0.26.0 arrives; meanwhile, alone on the GPU: decode
    # throughput (patched CUDA graphs vs the workarounds on the unpatched
    # wheel) and the continuation kernel benchmark on the wheels' FA2; then
    # the k8v4 output-equality pairs.
    "c4": {
        "parallel": 6,
        "jobs": jobs(
            f"{R0}:{P}:s_graph",
            f"{R0}:{U}:s_none",
            f"{R0}:{U}:s_eager",
            f"{R0}:{P}:cont_bench",  # (c) tq/0001, real FA2
            f"{R1}:{U}:cont_bench",  # (b) full dequant, v0.24.0-style reservation
            f"{R0}:{P}:k_m1",
            f"{R0}:{P}:ke_m1",
            f"{R0}:{P}:k_h1",
            f"{R0}:{P}:ke_h1",
            f"{R0}:{U}:cont_bench",  # (a) v0.20.2's per-layer buffers
            f"{R0}:{P}:s_spec_graph",
            f"{R0}:{U}:s_spec_none",
        ),
    },
    # c5: v0.26.0 and v0.27.1 complete. v0.26.0 is the newest release whose
    # wheel pins torch 2.11.0; v0.27.1 pins torch 2.13.0 but its
    # _C_stable_libtorch and FA2 resolve every torch symbol against 2.11.0
    # (nm here): a probe. Patched = the port of the fix where its overlay was
    # staged (build_stage.py --overlay v0.26.0:patched=DIR); without one the
    # patched jobs are recorded as "skipped: tree ... not staged" at no cost.
    "c5": {
        "parallel": 6,
        "jobs": jobs(
            f"{R2}:{U}:import",
            f"{R2}:{P}:import",
            f"{R3}:{U}:import",
            # chunked prefill off + a prefix hit: what v0.24.0+ still crash on
            f"{R2}:{U}:m2",
            f"{R2}:{P}:m2",
            f"{R2}:{U}:m1",
            f"{R2}:{P}:m1",
            f"{R2}:{U}:m4",
            f"{R2}:{P}:m4",
            f"{R2}:{U}:h1",
            f"{R2}:{P}:h1",
            f"{R3}:{U}:m1",
            f"{R3}:{U}:m4",
            f"{R3}:{U}:h1",
            f"{R2}:{U}:h4",
            f"{R2}:{P}:h4",
            f"{R3}:{P}:import",
            f"{R3}:{P}:m1",
            f"{R3}:{P}:m4",
            f"{R3}:{P}:h1",
            f"{R2}:{U}:m5",
            f"{R2}:{P}:m5",
        ),
    },
}

# Issue #25 (the plan's "Silent wrong outputs"): a second stage of v0.20.2 and
# v0.26.0 only (build_stage.py --prefix p): p1, p2 staging; p3 completes
# v0.20.2 (release, + tq) and runs its jobs; p4 completes v0.26.0 (release,
# + kvfix = the #50709 port, + patched = kvfix + tq-v0.33/0002, 0003) and
# runs its jobs: the parallel ones first (cold compile), then the timed
# ones alone.
K = "kvfix"
CALLS.update({
    "p1": {"parallel": 1, "jobs": []},
    "p2": {"parallel": 1, "jobs": []},
    "p3": {
        "parallel": 6,
        "jobs": jobs(
            f"{R0}:{U}:pfx",  # vllm#46460: H batched with F diverges from H alone
            f"{R0}:{P}:pfx",  # tq/0004: the same tokens as alone
            f"{R0}:{U}:pfx_auto",  # the bf16 reference (the patches touch only TurboQuant)
            f"{R0}:{P}:sd_ref",  # tq/0002 under ngram + full graphs: equal to no spec
            f"{R0}:{P}:sd_fs",
        ),
    },
    "p4": {
        "parallel": 8,
        "jobs": jobs(
            f"{R2}:{U}:sd_fa",  # #50709: TurboQuant on the V1 runner does not start
            f"{R2}:{K}:sd_ref",
            f"{R2}:{K}:sd_fa",  # full graphs + async: wrong (capture, host lengths)
            f"{R2}:{K}:sd_fs",  # full graphs: wrong (capture)
            f"{R2}:{K}:sd_pa",  # piecewise + async: wrong (host lengths)
            f"{R2}:{P}:sd_ref",
            f"{R2}:{P}:sd_fs",
            f"{R2}:{U}:pfx",  # vllm#46460 on the V2 runner
            f"{R2}:{P}:pfx",
            f"{R2}:{U}:pfx_auto",
            f"{R2}:{P}:sdx_fa",  # timed alone: the fix at full speed
            f"{R2}:{K}:sdx_ps",  # timed alone: the workarounds
            f"{R2}:{K}:sdx_es",
        ),
    },
    # p5: only if p4's deadline cut its timed jobs (no carry; same machine)
    "p5": {"parallel": 1, "jobs": jobs(f"{R2}:{P}:sdx_fa", f"{R2}:{K}:sdx_ps", f"{R2}:{K}:sdx_es")},
})

# Budgets (seconds from the start of call.sh, setup included) and the
# device tool's timeout_s for each call; the plan lists the run() calls.
BUDGET = {"c1": 150, "c2": 120, "c3": 420, "c4": 300, "c5": 240,
          "p1": 150, "p2": 120, "p3": 330, "p4": 560, "p5": 240}
