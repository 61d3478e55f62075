"""Every malformed cluster gets its own message that names the fix."""

import json

import pytest

from tfpar.errors import ClusterConfigError
from tfpar.strategy import cluster as cluster_lib


def tf_config(cluster, task=None, **extra):
    config = {"cluster": cluster, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


TWO_WORKERS = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}


def test_valid_config_parses():
    cluster = cluster_lib.parse_tf_config(tf_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    assert (cluster.task_type, cluster.task_index, cluster.num_tasks) == ("worker", 1, 2)
    assert cluster.address == "10.0.0.2:2222"
    assert cluster.peers() == [("worker", 0, "10.0.0.1:2222")]
    assert not cluster.is_chief and not cluster.has_ps
    resolver = cluster.resolver()
    assert resolver.cluster_spec().as_dict() == TWO_WORKERS
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


BAD_CONFIGS = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "has no 'cluster'"),
    (tf_config({"master": ["a:1"]}, {"type": "master", "index": 0}), "unknown job 'master'"),
    (tf_config({"worker": "a:1"}, {"type": "worker", "index": 0}), "non-empty list"),
    (tf_config({"worker": ["a"]}, {"type": "worker", "index": 0}), "is not 'host:port'"),
    (tf_config({"worker": ["a:99999"]}, {"type": "worker", "index": 0}), "port in 1..65535"),
    (tf_config(TWO_WORKERS), "no 'task'"),
    (tf_config(TWO_WORKERS, {"type": "chief", "index": 0}), "task type 'chief' is not a job"),
    (tf_config(TWO_WORKERS, {"type": "worker", "index": "1"}), "must be an integer"),
    (tf_config(TWO_WORKERS, {"type": "worker", "index": 2}), "out of range for job 'worker'"),
    (tf_config(TWO_WORKERS, {"type": "worker", "index": -1}), "valid: 0..1"),
    (tf_config({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}), "same address 'a:1'"),
    (tf_config({"worker": ["localhost:1", "10.0.0.2:1"]}, {"type": "worker", "index": 0}),
     "mixes loopback addresses"),
    (tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}, {"type": "worker", "index": 0}),
     "at most one"),
    (tf_config({"worker": ["a:1"], "ps": ["b:1"]}, {"type": "worker", "index": 0}),
     "needs one chief"),
]


@pytest.mark.parametrize("raw,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_tf_config_is_refused_with_its_own_message(raw, message):
    with pytest.raises(ClusterConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cluster_lib.parse_tf_config(raw)


def test_find_cluster_reads_tf_config_from_the_environment():
    environ = {"TF_CONFIG": tf_config(TWO_WORKERS, {"type": "worker", "index": 0})}
    assert cluster_lib.find_cluster(None, environ).source == "TF_CONFIG"
    assert cluster_lib.find_cluster(None, {}) is None
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not set"):
        cluster_lib.find_cluster("tf_config", {})
    with pytest.raises(ClusterConfigError, match="Unknown cluster source"):
        cluster_lib.find_cluster("kubernetes", {})


def test_dict_and_resolver_sources_pass_the_same_checks():
    good = {"cluster": TWO_WORKERS, "task": {"type": "worker", "index": 0}}
    assert cluster_lib.find_cluster(good).source == "cluster dict"
    with pytest.raises(ClusterConfigError, match="out of range"):
        cluster_lib.find_cluster({"cluster": TWO_WORKERS, "task": {"type": "worker", "index": 5}})
    resolver = cluster_lib.find_cluster(good).resolver()
    assert cluster_lib.find_cluster(resolver).jobs == {"worker": tuple(TWO_WORKERS["worker"])}


def test_slurm_environment_becomes_a_worker_cluster():
    environ = {
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "node[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_PROCID": "3",
    }
    cluster = cluster_lib.find_cluster(None, environ)
    assert cluster.source == "SLURM"
    assert cluster.jobs["worker"] == ("node01:8888", "node01:8889", "node02:8888", "node02:8889")
    assert (cluster.task_type, cluster.task_index) == ("worker", 3)
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID=7 is out of range"):
        cluster_lib.cluster_from_slurm({**environ, "SLURM_PROCID": "7"})
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST is not set"):
        cluster_lib.cluster_from_slurm({"SLURM_PROCID": "0"})
