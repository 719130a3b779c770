"""Rebase the real tq stack from v0.20.2 onto the v0.21.0 release (its wheel,
offline once cached), and check each patch's outcome against what the
upstream code at v0.21.0 actually does:

- tq/0001: v0.21.0 moved the continuation-prefill dequant buffers into the
  shared WorkspaceManager but reserves nothing before lock_workspace(), so
  the first large continuation after start-up crashes (vllm#41726). The patch
  does not apply there and its regression tests still fail: a real conflict.
- tq/0002: v0.21.0's TurboQuantMetadataBuilder passes query_start_loc_cpu and
  seq_lens_cpu, and forward() reads those host tensors (#41434): no sync.
  But a full CUDA graph captured on the runner's dummy metadata records the
  first-chunk branch, so a replayed verification batch ignores its cache:
  the patch does not apply and the differential test's graph replay fails
  there without it: a real conflict (tq-v0.33/0002 is that part, ported).
- tq/0003: v0.21.0 lifted the hybrid gate (upstream #39931) and sizes the
  hybrid page from TurboQuant's slot: not-needed.
- tq/0004: v0.21.0's prefill keeps the fast path of #46460; the patch
  applies as it is.
The test reads those facts from the v0.21.0 sources before it rebases, so a
wrong reading of upstream fails here rather than passing silently.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, git, isolated_cache, run_offline


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_offline(*args, cwd=cwd, timeout=3600)


def test_rebase_tq_stack_onto_v0_21_0(tmp_path: Path) -> None:
    isolated_cache(tmp_path)  # bases built here from the release wheels
    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("series", "patches", "tests"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, proj / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, proj / name)
    series = proj / "series"
    p = run("base", "v0.21.0", "--series", str(series), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    repo = p.stdout.split()[2].split("=", 1)[1]

    def src(path: str) -> str:
        return git("show", f"v0.21.0:{path}", cwd=Path(repo))

    tq = src("vllm/v1/attention/backends/turboquant_attn.py")
    args = src("vllm/engine/arg_utils.py")
    # 0001's bug: workspace buffers in the continuation, nothing reserved
    cont = tq[tq.index("def _continuation_prefill"):]
    assert "current_workspace_manager().get_simultaneous(" in cont
    builder = tq[tq.index("class TurboQuantMetadataBuilder"):
                 tq.index("class TurboQuantAttentionImpl")]
    assert "workspace" not in builder
    # 0002's sync fixed upstream (host copies in the metadata), not its
    # captured branch
    assert "query_start_loc_cpu=cam.query_start_loc_cpu" in tq
    # 0003 fixed upstream: no hybrid gate
    assert "not supported for hybrid" not in args

    p = run("rebase", "--onto", "v0.21.0", "--series", str(series),
            "--python", sys.executable, cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "CONFLICT: tq/0001-" in p.stdout
    assert "turboquant_attn.py" in p.stdout
    before = series.read_text()
    p = run("rebase", "--skip", "--series", str(series), "--python",
            sys.executable, cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "CONFLICT: tq/0002-" in p.stdout
    assert "test_graph_replay_matches_eager: fail (AssertionError: replay " \
        "differs from eager" in p.stdout
    p = run("rebase", "--skip", "--series", str(series), "--python",
            sys.executable, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert re.search(r"tq/0001-\S+\s+dropped", out)
    assert re.search(r"tq/0002-\S+\s+dropped", out)
    assert re.search(r"tq/0003-\S+\s+not-needed", out)
    assert re.search(r"tq/0004-\S+\s+clean", out)
    after = series.read_text()
    assert after != before
    assert "#@ stack tq repo=https://github.com/vllm-project/vllm tag=v0.21.0" \
        in after
    assert re.search(r"^#@ dropped tq/0002-\S+ base=v0.21.0 ", after, re.M)
    assert re.search(r"^#@ not-needed tq/0003-\S+ base=v0.21.0 ", after, re.M)
    assert re.search(r"^#@ dropped tq/0001-\S+ base=v0.21.0 ", after, re.M)
    assert (proj / "patches" / "tq").is_dir()  # files kept for history
    # the dsv4 stack is untouched
    assert before[before.index("#@ stack dsv4"):] in after
