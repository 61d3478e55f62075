"""The multi-node launch form: every node builds the same cluster from the same host list."""

import json

import pytest

from tfpar.multinode import NodePlan, NodePlanError


def test_every_node_builds_the_same_cluster_and_its_own_tasks():
    plans = [NodePlan.from_args("10.0.0.1,10.0.0.2", rank, workers_per_host=2, port=2222)
             for rank in (0, 1)]
    assert plans[0].cluster == plans[1].cluster == {
        "worker": ["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.2:2222", "10.0.0.2:2223"]}
    assert plans[0].local_workers == [0, 1] and plans[1].local_workers == [2, 3]
    config = json.loads(plans[1].tf_config(3))
    assert config["task"] == {"type": "worker", "index": 3} and config["cluster"] == plans[0].cluster


def test_slurm_gives_the_hosts_and_the_rank():
    plan = NodePlan.from_slurm({"SLURM_JOB_NODELIST": "node[1-2,10]", "SLURM_NODEID": "2"})
    assert plan.hosts == ("node1", "node2", "node10") and plan.local_workers == [2]
    with pytest.raises(NodePlanError, match="SLURM_NODEID"):
        NodePlan.from_slurm({"SLURM_JOB_NODELIST": "node1"})


@pytest.mark.parametrize("hosts, rank, message", [
    ("10.0.0.1,10.0.0.2", 2, "out of range"),
    ("10.0.0.1:2222,10.0.0.2", 0, "without ports"),
    ("a,a", 0, "twice"),
    ("", 0, "host names"),
])
def test_bad_host_lists_are_refused_with_the_fix(hosts, rank, message):
    with pytest.raises(NodePlanError, match=message):
        NodePlan.from_args(hosts, rank)


def test_tfpar_launch_gives_this_nodes_workers_the_shared_cluster(tmp_path):
    import subprocess
    import sys

    from procs import env, free_port_pair

    port = free_port_pair()
    show = "import os; print('CONFIG', os.environ['TF_CONFIG'])"
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "127.0.0.1", "--node-rank", "0",
         "--workers-per-host", "2", "--port", str(port), "--", sys.executable, "-c", show],
        env=env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    configs = sorted((json.loads(line.split("CONFIG ", 1)[1]) for line in result.stdout.splitlines()
                     if "CONFIG " in line), key=lambda c: c["task"]["index"])
    addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    assert all(c["cluster"] == {"worker": addresses} for c in configs)
