"""The orchestrator's side: start one worker process per task on a link, wait, collect.

loopback: tfpar.launch's local cluster on 127.0.0.1. A rate (100mbit, 1gbit): the shaped
namespaces of .links, each worker started inside its own (`ip netns exec`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from . import links
from .configs import HERE, REPO

ENTRY = os.path.join(HERE, "compression.py")  # the script the workers run (--worker)


def _worker_args(args, result_file: str) -> list[str]:
    return [sys.executable, ENTRY, "--worker", f"--result-file={result_file}",
            f"--model={args.model}", f"--batch={args.batch}", f"--steps={args.steps}",
            f"--compressed-steps={args.compressed_steps}", f"--steps-per-loop={args.steps_per_loop}",
            f"--eval-every={args.eval_every}", f"--eval-examples={args.eval_examples}",
            f"--warmup-calls={args.warmup_calls}", f"--configs={','.join(args.configs)}",
            f"--bytes-at-step={args.bytes_at_step}"]


def _pump(stream, prefix: str, log) -> None:
    for line in iter(stream.readline, ""):
        log.write(f"{prefix} {line}")
        log.flush()
        if re.match(r"\[w\d\] ", line) or "Error" in line or "Traceback" in line:
            print(f"{prefix} {line}", end="", flush=True)


def _start(prefixes, cluster, args, result_file, link, log):
    processes, pumps = [], []
    for index, prefix in enumerate(prefixes):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        processes.append(subprocess.Popen(prefix + _worker_args(args, result_file), env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO))
        pumps.append(threading.Thread(target=_pump, args=(processes[-1].stdout, f"[{link}]", log), daemon=True))
        pumps[-1].start()
    return processes, pumps


def _stop(processes, pumps) -> None:
    for p in processes:  # only the process groups this script started
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for thread in pumps:
        thread.join(timeout=5)


def _wait(processes, key: str, log_path: str) -> None:
    while True:
        codes = [p.poll() for p in processes]
        if any(c not in (None, 0) for c in codes):
            raise RuntimeError(f"{key}: a worker exited with {codes}; see {log_path}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.5)


def _collect(result_file: str, workers: int, log_path: str) -> dict:
    """Worker 0's results, each row marked with whether every worker computed the same losses."""
    loaded = []
    for task in range(workers):
        with open(result_file.replace("{task}", str(task))) as f:
            loaded.append(json.load(f))
    chief = loaded[0]
    for name, row in chief["results"].items():
        row["workers_agree"] = all(abs(a[1] - b[1]) < 1e-6 for other in loaded[1:] for a, b in
                                   zip(row["val_loss"], other["results"][name]["val_loss"]))
    chief["log"] = log_path
    return chief


def run_cluster(link: str, workers: int, args, workdir: str) -> dict:
    """Starts `workers` workers on `link` (loopback or shaped), waits; returns worker 0's results."""
    key = f"{link}_w{workers}"
    result_file = os.path.join(workdir, f"{key}_worker{{task}}.json")
    log_path = os.path.join(workdir, f"{key}.log")
    if link == "loopback":
        from tfpar.launch import cluster_spec
        cluster, prefixes = cluster_spec(workers), [[] for _ in range(workers)]
    else:
        cluster = {"worker": [f"{address}:{links.PORT}" for address in links.addresses(workers)]}
        prefixes = [["ip", "netns", "exec", ns] for ns in links.namespaces(workers)]
    with open(log_path, "w") as log:
        processes, pumps = _start(prefixes, cluster, args, result_file, key, log)
        try:
            _wait(processes, key, log_path)
        finally:
            _stop(processes, pumps)
    return _collect(result_file, workers, log_path)


def run_link(link: str, workers: int, args, workdir: str, meta: dict) -> dict:
    """run_cluster on `link`; a rate is set up first (root), probed, and torn down after.
    The link's description goes into meta["LINK_wN"]."""
    if link == "loopback":
        return run_cluster(link, workers, args, workdir)
    if os.geteuid() != 0:
        raise SystemExit(f"link {link} needs root (ip netns, tc); run --links=loopback without it")
    try:
        chain = links.setup_link(link, workers, args.delay)
        info = {"rate": link, "delay": args.delay, "qdisc_chain": chain, "namespaces": links.namespaces(workers),
                "addresses": links.addresses(workers), "bridge": f"{links.BRIDGE} in namespace {links.HUB}",
                "qdisc": f"{chain}, burst 64kbit latency 50ms, on each worker's veth",
                **links.measure_link(args.probe_mb)}
        print(f"link {link}, {workers} workers: {info}", flush=True)
        chief = run_cluster(link, workers, args, workdir)
        info["qdisc_stats_after"] = links.qdisc_stats(workers)
        meta[f"{link}_w{workers}"] = info
        return chief
    finally:
        links.teardown_link()
