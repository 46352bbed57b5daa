"""Two torchrun agents on this machine stand in for two nodes: ctx ranks on one, gen ranks on the
other, rendezvous through c10d. A verified run, written to one run directory named by the rdzv id
(TORCHELASTIC_RUN_ID), because both agents start from the same working directory."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import check_figures

from kvlab.cli.launch import reserve_port


@pytest.mark.slow
def test_ctx_node_and_gen_node_verified_in_one_run_dir(tmp_path, kvlab_cli):
    reserved, rdzv_id = reserve_port(), "kvlab-two-nodes"
    port = reserved.getsockname()[1]
    agents = []
    for node in (0, 1):
        cmd = kvlab_cli.argv("run", "logger=quiet", "ctx.tp=2", "gen.tp=2", "workload.requests=2",
                             torchrun=["--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}"])
        agents.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1")))
    outs = []
    try:
        outs = [a.communicate(timeout=150) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        reserved.close()
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for _, e in outs]

    runs = list((tmp_path / "outputs").iterdir())
    assert [r.name for r in runs] == [rdzv_id]  # both agents' ranks in one directory
    run = runs[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verified"] and summary["world_size"] == 4 and summary["requests"] == 2
    check_figures(run)
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    parts = {r: json.loads((run / "parts" / f"rank{r}.json").read_text()) for r in range(4)}
    node = {r: p["node"] for r, p in parts.items()}  # GROUP_RANK: the agent that started the rank
    assert [parts[r]["side"] for r in range(4)] == ["ctx", "ctx", "gen", "gen"]
    assert node[0] == node[1] != node[2] == node[3]  # ctx ranks on one node, gen ranks on the other
    assert sum("results in" in o for o, _ in outs) == 1  # one report, by rank 0
