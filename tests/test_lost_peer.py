"""A lost peer is named by its host, not only by its task."""

import json

from tfpar.strategy.lost_peer import describe_lost_peer

CLUSTER = {"worker": ["10.9.0.1:2222", "10.9.0.2:2222"]}
SEEN = ("Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
        "The tasks have crashed.")


def test_the_lost_task_is_named_with_its_address():
    assert describe_lost_peer(SEEN, CLUSTER, this_task=("worker", 0)) == "worker 1 at 10.9.0.2:2222"


def test_this_workers_own_task_is_not_the_lost_one(monkeypatch):
    message = "from /job:worker/replica:0/task:1 ... peer /job:worker/replica:0/task:0"
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 1}}))
    assert describe_lost_peer(message) == "worker 0 at 10.9.0.1:2222"


def test_no_task_in_the_message_names_nobody():
    assert describe_lost_peer("Deadline Exceeded", CLUSTER) is None
    assert describe_lost_peer("/job:chief/task:3 gone", CLUSTER) == "chief 3"


def test_an_address_in_the_message_names_its_task():
    message = "failed to connect to all addresses; last error: ipv4:10.9.0.2:2222: Connection refused"
    assert describe_lost_peer(message, CLUSTER, this_task=("worker", 0)) == "worker 1 at 10.9.0.2:2222"
