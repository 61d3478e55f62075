"""tfpar-check: is this machine (or cluster) ready to train? Like nccl-tests or ds_report.

Reports the versions (with the TPU build and libtpu where installed), the devices, which
strategy `auto` picks and why, the cluster and its pre-flight check, then measures:
all-reduce latency and bus bandwidth for a few sizes under that strategy (nccl-tests'
busbw = algbw * 2(n-1)/n), matmul throughput per device (10 timed n x n products, n = 8192
on a GPU or TPU, 2048 on a CPU; on a GPU with TF32 float32 twice: TF32 math, TensorFlow's
default there, and with TF32 off), and one training step of a small GPT in Keras fit and in
tfpar's loop, checked equal. A Keras backend other than TensorFlow is NOT READY at once.
It ends with one verdict line; `--json` prints one JSON object (one line) instead. Under
`tfpar-launch --workers N` every worker runs it; each prints its own.

Example:
    $ tfpar-check                                  # this machine, strategy 'auto'
    $ tfpar-check --strategy=mirrored --virtual-devices=2 --small
    $ tfpar-launch --workers 2 -- tfpar-check --json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import time
from typing import Any, Sequence

from tfpar.check_probes import (EQUAL_TOL, all_reduce_table, fit_and_loop_step,  # noqa: F401
                                matmul_throughput)

SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20)  # bytes per all-reduce
SMALL_SIZES = (4 << 10, 64 << 10)


@dataclasses.dataclass
class Options:
    strategy: str = "auto"
    virtual_devices: int | None = None
    sizes: tuple[int, ...] = SIZES
    iterations: int = 20
    matmul: int | None = None  # n of the n x n matmul; None: 8192 on a GPU or TPU, 2048 on a CPU
    matmul_iterations: int = 10
    connect_timeout_s: float = 60.0


def versions() -> dict:
    """Versions, Keras's read from its metadata (importing it fails on a non-TF backend).

    Example:
        >>> versions()["libtpu"]  # None without; "0.0.52", or "libtpu-nightly 0.1.dev..."
    """
    import tensorflow as tf

    import tfpar

    return {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": _distribution("keras"), "tfpar": tfpar.__version__,
            "tensorflow_tpu": _distribution("tensorflow-tpu"),
            "libtpu": _distribution("libtpu") or _distribution("libtpu-nightly", named=True),
            "platform": platform.platform()}


def _distribution(name: str, named: bool = False) -> str | None:
    """The installed version of distribution `name` ("name version" if `named`), or None."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"{name} {version}" if named else version


def _gpu_memory_mb(index: int) -> int | None:
    """Total memory of GPU `index` from nvidia-smi (TensorFlow reports only what it uses)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def devices() -> dict:
    """Physical devices: CPU cores, GPUs (name, memory), TPU cores."""
    import tensorflow as tf

    gpus = []
    for index, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append({"name": details.get("device_name", gpu.name), "memory_mb": _gpu_memory_mb(index),
                     "compute_capability": details.get("compute_capability")})
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_cores": cpus, "gpus": gpus,
            "tpu_cores": len(tf.config.list_logical_devices("TPU"))}


def choose(options: Options) -> tuple[str, Any, str]:
    """(strategy name, cluster, why): `auto`'s decision, or the one asked for."""
    from tfpar.strategy import factory

    kind = factory.normalize_name(options.strategy)
    if kind != "auto":
        return kind, None, "asked for with --strategy"
    return factory._decide(None, None)  # pylint: disable=protected-access


def cluster_report(cluster) -> dict | None:
    """The cluster (TF_CONFIG / SLURM), or None on a single machine."""
    from tfpar.strategy import cluster as cluster_lib

    found = cluster if isinstance(cluster, cluster_lib.Cluster) else cluster_lib.find_cluster()
    if found is None:
        return None
    return {"source": found.source, "jobs": {job: list(a) for job, a in found.jobs.items()},
            "task": f"{found.task_type}[{found.task_index}]",
            "peers": [f"{job}[{i}] {address}" for job, i, address in found.peers()]}


def make_strategy(kind: str, cluster, options: Options):
    """The strategy; for a cluster, create_strategy's pre-flight check reaches every peer first."""
    import tfpar

    started = time.monotonic()
    strategy = tfpar.create_strategy(kind, cluster=cluster, virtual_devices=options.virtual_devices,
                                     connect_timeout_s=options.connect_timeout_s)
    return strategy, time.monotonic() - started


# -- the report -------------------------------------------------------------------------

def collect(options: Options) -> dict:
    """Everything tfpar-check reports, as one dict (what --json prints)."""
    report: dict[str, Any] = {"versions": versions(), "problems": [], "warnings": []}
    from tfpar.strategy import keras_backend

    try:
        keras_backend.check_keras_backend()  # before anything imports Keras (KERAS_BACKEND=jax)
    except keras_backend.KerasBackendError as e:
        report.update(strategy={"name": options.strategy, "why": "not created"}, cluster=None)
        report["problems"].append(str(e))
        return report
    kind, cluster, why = choose(options)
    report["strategy"] = {"name": kind, "why": why}
    report["cluster"] = cluster_report(cluster)
    from tfpar.errors import TfparError

    try:
        strategy, seconds = make_strategy(kind, cluster, options)
    except TfparError as e:  # unreachable peer, bad cluster, TPU missing...
        report["problems"].append(str(e))
        return report
    if report["cluster"] is not None:
        report["cluster"]["preflight"] = f"all {len(report['cluster']['peers'])} peer(s) answered"
        report["cluster"]["connect_s"] = seconds
    report["devices"] = devices()
    _measure(report, strategy, options)
    return report


def _measure(report: dict, strategy, options: Options) -> None:
    from tfpar.strategy import describe, keras_fixes

    info = describe(strategy)
    report["strategy"].update(replicas=info.replicas, workers=info.num_workers,
                              devices=list(info.devices))
    fixes = keras_fixes.status()
    report["keras_fixes"] = {"applied": fixes.applied, "message": fixes.message()}
    if not fixes.applied:
        report["warnings"].append(fixes.message())
    if "ParameterServer" not in type(strategy).__name__:
        report["all_reduce"] = all_reduce_table(strategy, options.sizes, options.iterations)
    report["matmul"] = matmul_throughput(list(info.devices), options.matmul,
                                         options.matmul_iterations)
    step = fit_and_loop_step(strategy)
    report["fit_vs_loop"] = step
    if "equal" in step and not step["equal"]:
        report["problems"].append(
            f"one GPT step in Keras fit and in tfpar's loop differ by {step['max_difference']:.2e} "
            f"(> {EQUAL_TOL:g}): report it with this output.")


def verdict(report: dict) -> str:
    """One line: READY, READY with warnings, or NOT READY and the first problem."""
    strategy = report.get("strategy", {})
    where = f"{strategy.get('name')} x{strategy.get('replicas', '?')}"
    if report["problems"]:
        return f"NOT READY ({where}): {report['problems'][0]}"
    if report["warnings"]:
        return f"READY with warnings ({where}): {report['warnings'][0]}"
    return f"READY: {where} replicas, fit equals tfpar's loop, all-reduce and matmul measured."


def render(report: dict) -> str:
    """The human-readable report."""
    v, lines = report["versions"], []
    tpu_build = ", ".join(str(v[key]) if str(v[key]).startswith(name) else f"{name} {v[key]}"
                          for name, key in (("tensorflow-tpu", "tensorflow_tpu"), ("libtpu", "libtpu"))
                          if v.get(key))
    tpu_build = f" ({tpu_build})" if tpu_build else ""
    lines.append(f"versions   python {v['python']}  tensorflow {v['tensorflow']}{tpu_build}  "
                 f"keras {v['keras']}  tfpar {v['tfpar']}")
    d = report.get("devices")
    if d:
        gpus = ", ".join(f"{g['name']} ({g['memory_mb'] or '?'} MiB)" for g in d["gpus"]) or "none"
        lines.append(f"devices    {d['cpu_cores']} CPU cores; GPUs: {gpus}; TPU cores: {d['tpu_cores']}")
    s = report["strategy"]
    lines.append(f"strategy   {s['name']}: {s['why']}")
    c = report.get("cluster")
    lines.append("cluster    none (one process)" if c is None else
                 f"cluster    {c['source']}, this task {c['task']}, peers: {', '.join(c['peers'])}; "
                 f"{c.get('preflight', 'pre-flight failed')}")
    if "keras_fixes" in report:
        lines.append(f"keras      {report['keras_fixes']['message']}")
    lines += _tables(report)
    lines.append(verdict(report))
    return "\n".join(lines)


def _tables(report: dict) -> list[str]:
    lines = []
    if report.get("all_reduce"):
        lines.append(f"all-reduce ({report['strategy']['replicas']} replicas, float32 sum)")
        lines.append(f"  {'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        lines += [f"  {r['bytes']:>12} {r['time_us']:>12.1f} {r['algbw_gbs']:>13.3f} {r['busbw_gbs']:>13.3f}"
                  for r in report["all_reduce"]]
    for r in report.get("matmul", ()):
        lines.append(f"matmul     {r['device']} {r['math']}: {r['tflops']:.3f} TFLOP/s "
                     f"(n = {r['n']}, {r['iterations']} iterations)")
    step = report.get("fit_vs_loop")
    if step:
        lines.append("train step " + (step["skipped"] if "skipped" in step else
                     f"fit vs loop max difference {step['max_difference']:.1e} "
                     f"({'equal' if step['equal'] else 'DIFFERENT'}); fit {step['fit_s']:.1f} s, "
                     f"loop {step['loop_s']:.1f} s (first step: includes tracing)"))
    return lines


def _parse(argv: Sequence[str] | None) -> tuple[Options, bool]:
    parser = argparse.ArgumentParser(prog="tfpar-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="auto", help="strategy to check (default: auto)")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="split the CPU (or each GPU) into N logical devices first")
    parser.add_argument("--small", action="store_true", help="small sizes (CI, a quick look)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds the pre-flight check waits for every peer")
    args = parser.parse_args(argv)
    options = Options(strategy=args.strategy, virtual_devices=args.virtual_devices,
                      connect_timeout_s=args.connect_timeout)
    if args.small:
        options.sizes, options.iterations, options.matmul = SMALL_SIZES, 5, 128
    return options, args.json


def run(argv: Sequence[str] | None = None) -> None:
    """Console entry point: prints the report (or JSON); exits 1 when NOT READY."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    options, as_json = _parse(sys.argv[1:] if argv is None else argv)
    report = collect(options)
    report["verdict"] = verdict(report)
    print(json.dumps(report) if as_json else render(report), flush=True)
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    run()
