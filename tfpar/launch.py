"""Local multi-process runs, like torchrun for TensorFlow.

    python -m tfpar.launch --workers 2 -- python -m tfpar.train --config=configs/gpt_tiny.py
    tfpar-launch --chief --workers 2 --ps 1 -- python my_ps_script.py
    tfpar-launch --hosts 10.0.0.1,10.0.0.2 --node-rank 0 -- python -m tfpar.train ...  # on each machine

Picks free ports on 127.0.0.1, gives each process its TF_CONFIG, prefixes every output
line with its task (`[worker:1] ...`), pins CPUs when asked, stops the whole group with a
non-zero exit as soon as any task fails (except a parameter-server worker: that one is
restarted while training goes on), and passes Ctrl-C / SIGTERM on to every task. With
`--max-restarts K` a failed or preempted group (any task's non-zero exit, e.g. 75 after
a preemption checkpoint) is started again, on fresh ports, up to K times: tfpar-train
resumes from its newest checkpoint.

The cluster's addresses are 127.0.0.1, but TensorFlow's gRPC server listens on every
interface of the machine (it binds 0.0.0.0) and authenticates nobody: run it only on a
machine whose ports a firewall keeps from networks you do not trust.

Example (Python):
    >>> from tfpar.launch import launch
    >>> launch(["python", "train.py"], workers=2)      # returns the group's exit code
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence, TextIO

from tfpar.multinode import DEFAULT_PORT, NodePlan, NodePlanError

HOST = "127.0.0.1"
GRACE_S = 10.0


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports that are free right now on `host`."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def cluster_spec(workers: int, ps: int = 0, chief: bool = False, host: str = HOST) -> dict:
    """The cluster part of TF_CONFIG for a local group, on fresh free ports."""
    counts = {"chief": int(chief), "worker": workers, "ps": ps}
    ports = iter(free_ports(sum(counts.values()), host))
    return {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in counts.items() if n}


class _Task:
    def __init__(self, job: str, index: int, process: subprocess.Popen, cpus=None):
        self.job, self.index, self.process, self.cpus = job, index, process, cpus
        self.name = f"{job}:{index}"
        self.restarts = 0


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix} {line}" if line.endswith("\n") else f"{prefix} {line}\n")
            out.flush()
    stream.close()


def _cpu_sets(count: int, cpus_per_task: int | None) -> list[list[int] | None]:
    if not cpus_per_task:
        return [None] * count
    available = sorted(os.sched_getaffinity(0))
    return [
        [available[(i * cpus_per_task + k) % len(available)] for k in range(cpus_per_task)]
        for i in range(count)
    ]


def _check_request(command, workers: int, ps: int, chief: bool, max_restarts: int, node) -> None:
    """One clear refusal for a launch that cannot work."""
    if not command:
        raise SystemExit("tfpar-launch: no command given. Usage: tfpar-launch --workers 2 -- CMD ...")
    if workers < 1 and not chief:
        raise SystemExit("tfpar-launch: need at least one worker (--workers N) or --chief.")
    if max_restarts < 0:
        raise SystemExit("tfpar-launch: --max-restarts must be >= 0.")
    if node is not None and (ps or chief):
        raise SystemExit("tfpar-launch: --hosts runs workers only (multi_worker_mirrored); "
                         "a chief and parameter servers are not supported across hosts yet.")
    if ps and not chief:
        raise SystemExit(
            "tfpar-launch: --ps needs --chief: parameter-server training is driven by a chief "
            "(coordinator). Add --chief."
        )


def launch(
    command: Sequence[str],
    workers: int = 1,
    ps: int = 0,
    chief: bool = False,
    cpus_per_worker: int | None = None,
    env: dict | None = None,
    out: TextIO | None = None,
    max_worker_restarts: int = 3,
    max_restarts: int = 0,
    node: NodePlan | None = None,
) -> int:
    """Runs `command` once per task of a local cluster; returns the group's exit code.

    `node`: this machine's part of a multi-node cluster (tfpar.multinode.NodePlan): its
    workers get the cluster every node builds from the same host list, on fixed ports, so
    that groups restarted on each node (max_restarts) meet again.

    `max_restarts`: start the whole group again (fresh ports) after it failed, at most
    this many times; each task sees TFPAR_LAUNCH_ATTEMPT=0, 1, ...

    0 when every chief/worker exits 0 (ps servers are then stopped); otherwise the
    exit code of the first task that failed, after the others are stopped. In a
    parameter-server cluster a failed worker is not fatal: the chief's coordinator runs
    its work elsewhere, and the launcher starts it again (at most `max_worker_restarts`
    times per worker), after which the coordinator gives it work again.
    """
    _check_request(command, workers, ps, chief, max_restarts, node)
    out = out or sys.stdout
    lock = threading.Lock()
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            code = _run_group(command, workers, ps, chief, cpus_per_worker, env, out, lock,
                              received, max_worker_restarts, attempt, node)
            if code == 0 or received or attempt == max_restarts:
                return code
            where = "on fresh ports" if node is None else "on the same ports (every node restarts its own)"
            _say(out, lock, f"the group failed (exit code {code}); restarting it "
                            f"({attempt + 1}/{max_restarts}) {where}.")
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(out: TextIO, lock: threading.Lock, message: str) -> None:
    with lock:
        out.write(f"[tfpar-launch] {message}\n")
        out.flush()


def _run_group(command, workers, ps, chief, cpus_per_worker, env, out, lock, received,
               max_worker_restarts, attempt, node=None) -> int:
    """Starts every task of a fresh local cluster (or this node's workers of a multi-node
    one) and supervises it to the end."""
    if node is None:
        cluster = cluster_spec(workers, ps, chief)
        order = [(job, i) for job in ("chief", "worker", "ps") for i in range(len(cluster.get(job, [])))]
    else:
        cluster, order = node.cluster, [("worker", i) for i in node.local_workers]
    cpu_sets = _cpu_sets(len(order), cpus_per_worker)
    pumps: list[threading.Thread] = []
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    base_env["TFPAR_LAUNCH_ATTEMPT"] = str(attempt)

    def spawn(job: str, index: int, cpus) -> _Task:
        task_env = dict(base_env)
        task_env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        preexec = (lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None
        process = subprocess.Popen(
            list(command), env=task_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
            preexec_fn=preexec,
        )
        task = _Task(job, index, process, cpus)
        _say(out, lock, f"{task.name} started (pid {process.pid})")
        thread = threading.Thread(target=_pump, args=(process.stdout, f"[{task.name}]", out, lock),
                                  daemon=True)
        thread.start()
        pumps.append(thread)
        return task

    tasks = [spawn(job, index, cpus) for (job, index), cpus in zip(order, cpu_sets)]
    # Under a ps cluster only the chief finishes; workers and ps serve until stopped.
    drivers = [t for t in tasks if t.job == "chief"] if ps else [t for t in tasks if t.job != "ps"]
    try:
        respawn = (lambda task: spawn(task.job, task.index, task.cpus)) if ps else None
        return _supervise(tasks, drivers, received, out, lock, respawn, max_worker_restarts)
    finally:
        for thread in pumps:
            thread.join(timeout=5)


def _supervise(tasks, drivers, received, out, lock, respawn, max_worker_restarts) -> int:
    def say(message: str) -> None:
        _say(out, lock, message)

    while True:
        if received:
            signum = received[0]
            say(f"got {signal.Signals(signum).name}; passing it to every task.")
            _stop(tasks, signum)
            return 128 + signum
        failed = [t for t in tasks if t.process.poll() not in (None, 0)]
        for task in [t for t in failed if respawn and t.job == "worker"]:
            if task.restarts >= max_worker_restarts:
                break
            say(f"{task.name} exited with code {task.process.returncode}; parameter-server "
                f"training goes on without it. Restarting it ({task.restarts + 1}/"
                f"{max_worker_restarts}).")
            new = respawn(task)
            new.restarts = task.restarts + 1
            tasks[tasks.index(task)] = new
            failed.remove(task)
        if failed:
            first = failed[0]
            say(f"{first.name} exited with code {first.process.returncode}; stopping the group.")
            _stop(tasks, signal.SIGTERM)
            return first.process.returncode if first.process.returncode > 0 else 1
        if all(t.process.poll() == 0 for t in drivers):
            _stop([t for t in tasks if t.process.poll() is None], signal.SIGTERM)
            return 0
        stray = [t for t in tasks if t not in drivers and t.process.poll() == 0]
        if stray and any(t.job == "ps" for t in stray):
            say(f"{stray[0].name} exited early; stopping the group.")
            _stop(tasks, signal.SIGTERM)
            return 1
        time.sleep(0.1)


def _stop(tasks, signum: int) -> None:
    for task in tasks:
        if task.process.poll() is None:
            try:
                os.killpg(task.process.pid, signum)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + GRACE_S
    for task in tasks:
        try:
            task.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(task.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            task.process.wait()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tfpar-launch",
        description="Run a command as a local TensorFlow cluster (one process per task).",
        epilog="Example: tfpar-launch --workers 2 -- python -m tfpar.train --config=configs/gpt_tiny.py",
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--ps", type=int, default=0, help="parameter-server processes (needs --chief)")
    parser.add_argument("--chief", action="store_true", help="add a chief task")
    parser.add_argument("--cpus-per-worker", type=int, default=None,
                        help="pin each task to this many CPUs (round robin over the allowed CPUs)")
    parser.add_argument("--max-worker-restarts", type=int, default=3,
                        help="parameter-server clusters: restart a failed worker up to this many "
                             "times (default 3); training goes on meanwhile")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group up to this many times after a task fails "
                             "or is preempted (default 0); tfpar-train resumes from its checkpoint")
    nodes = parser.add_argument_group(
        "several machines", "run the same command on every machine, each with its --node-rank")
    nodes.add_argument("--hosts", default=None,
                       help="every machine's address, comma-separated, the same on every machine; "
                            "'slurm' reads SLURM_JOB_NODELIST and SLURM_NODEID")
    nodes.add_argument("--node-rank", type=int, default=None, help="this machine's place in --hosts")
    nodes.add_argument("--workers-per-host", type=int, default=1, help="workers on each machine (default 1)")
    nodes.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help=f"first port of each machine's workers (default {DEFAULT_PORT})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    args.node = None
    if args.hosts is not None or args.node_rank is not None:
        try:
            args.node = _node_plan(args)
        except NodePlanError as e:
            parser.error(str(e))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given; put it after --, e.g. tfpar-launch --workers 2 -- python train.py")
    return args


def _node_plan(args: argparse.Namespace) -> NodePlan:
    if args.hosts == "slurm":
        return NodePlan.from_slurm(workers_per_host=args.workers_per_host, port=args.port)
    if args.hosts is None or args.node_rank is None:
        raise NodePlanError("--hosts and --node-rank go together, e.g. --hosts 10.0.0.1,10.0.0.2 "
                            "--node-rank 0 on the first machine (or --hosts slurm).")
    return NodePlan.from_args(args.hosts, args.node_rank, args.workers_per_host, args.port)


def run(argv: Sequence[str] | None = None) -> None:
    """Console entry point (`tfpar-launch`)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    sys.exit(launch(args.command, workers=args.workers, ps=args.ps, chief=args.chief,
                    cpus_per_worker=args.cpus_per_worker,
                    max_worker_restarts=args.max_worker_restarts,
                    max_restarts=args.max_restarts, node=args.node))


if __name__ == "__main__":
    run()
