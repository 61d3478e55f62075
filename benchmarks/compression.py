"""Benchmark: gradient compression for gpt_tiny on 2 workers: bytes, step time, validation loss.

    python benchmarks/compression.py                                   # loopback + shaped link
    python benchmarks/compression.py --links=loopback --steps=100      # no root needed
    python benchmarks/compression.py --links=shaped --rate=100mbit     # root + iproute2 (tc)

gpt_tiny (configs/gpt_tiny.py: 2 blocks of 128, 128-byte windows, AdamW with 60 warm-up
steps and cosine decay over --steps), global batch 32 over 2 workers under
multi_worker_mirrored (one CPU replica each), the same seed and data order for every
compressor. Each worker process trains every configuration in turn (a fresh model and
optimizer each, seeded alike), so TensorFlow and the cluster start once per link.

Per configuration: bytes one replica hands to collectives per step and the ratio to one
float32 all-reduce (Trainer.wire_bytes, counted from the traced step), the validation loss
on a fixed subset (the first --eval-examples validation windows) every --eval-every steps,
and the step time (median over the tf.function calls of --steps-per-loop steps after the
first --warmup-calls, evaluation excluded).

Links:
  loopback  tfpar.launch's local cluster on 127.0.0.1 (no shaping; CPU-bound).
  shaped    two network namespaces (tfpA, tfpB) joined by a veth pair (10.0.0.1 <-> 10.0.0.2),
            a token-bucket filter of --rate on both ends; worker 0 runs in tfpA and worker 1 in
            tfpB. A 50 MB TCP transfer through the link checks the shaping first. The
            namespaces are removed at the end, also on errors and Ctrl-C.

Configurations: none, fp16, bf16, int8, topk(0.01), powersgd(4), sign with tfpar's default
policy (biases, norms, embeddings and tensors < 1024 elements stay float32), plus
topk(0.01)+emb and powersgd(4)+emb, where Policy(overrides={'embed': compressor}) compresses
the token and position embeddings too. The JSON also carries the analytic bytes of every
compressor with nothing left out (Policy(min_size=0, skip=())) and PowerSGD's bound.

Writes OUT/compression.json and OUT/compression.png and prints a table. Speed lives here,
never in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(REPO, "configs", "gpt_tiny.py")

# name -> (compressor name, its args, also compress the embeddings)
CONFIGS = {
    "none": ("none", {}, False),
    "fp16": ("fp16", {}, False),
    "bf16": ("bf16", {}, False),
    "int8": ("int8", {}, False),
    "topk(0.01)": ("topk", {"ratio": 0.01}, False),
    "topk(0.01)+emb": ("topk", {"ratio": 0.01}, True),
    "powersgd(4)": ("powersgd", {"rank": 4}, False),
    "powersgd(4)+emb": ("powersgd", {"rank": 4}, True),
    "sign": ("sign", {}, False),
}
GOAL_CONFIGS = ("topk(0.01)", "topk(0.01)+emb", "powersgd(4)", "powersgd(4)+emb")
GOAL_RATIO, GOAL_SPEEDUP, GOAL_GAP = 40.0, 3.0, 0.03
EMBED = r"embed"

NAMESPACES = ("tfpA", "tfpB")
VETH = ("vtfpA", "vtfpB")
ADDRESSES = ("10.0.0.1", "10.0.0.2")
PORT = 23456


# -- the worker (one per task; TF_CONFIG from the environment) -----------------------------

def compression_for(name: str):
    from tfpar import compression as C

    kind, kwargs, embed = CONFIGS[name]
    compressor = C.get(kind, **kwargs)
    return C.Compression(compressor, C.Policy(overrides={EMBED: compressor} if embed else {}))


def analytic_bytes(variables, compressor, policy) -> int:
    """Bytes per replica per step by the compressors' own sizes (pure Python, no TF ops)."""
    from tfpar.compression.compressed_aggregator import SIZE_EXCHANGE_BYTES
    from tfpar.compression.compressors import GatherCompressor

    total, gathers = 0, False
    for v in variables:
        shape = tuple(v.shape)
        chosen = policy.choose(v.path, shape, compressor)
        size = math.prod(shape)
        total += chosen.payload_bytes(size, shape) if chosen else 4 * size
        gathers |= isinstance(chosen, GatherCompressor)
    return total + (SIZE_EXCHANGE_BYTES if gathers else 0)


def plans(variables) -> dict:
    """Per configuration: which variables each compressor takes (the rest go float32)."""
    from tfpar import compression as C

    out = {}
    for name in CONFIGS:
        compression = compression_for(name)
        out[name] = {v.path: repr(c) if c else "float32" for v, c in zip(
            variables, [compression.policy.choose(v.path, tuple(v.shape), compression.compressor)
                        for v in variables])}
    everything = C.Policy(min_size=0, skip=())
    out_all = {}
    for kind, kwargs in [("fp16", {}), ("int8", {}), ("topk", {"ratio": 0.01}),
                         ("powersgd", {"rank": 4}), ("sign", {})]:
        compressor = C.get(kind, **kwargs)
        out_all[repr(compressor)] = analytic_bytes(variables, compressor, everything)
    return {"plans": out, "analytic_everything_compressed": out_all}


def worker(args) -> None:
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=args.connect_timeout)
    info = tfpar.describe(strategy)  # first: nothing may touch TensorFlow before the strategy

    import runpy

    import keras

    from tfpar import data as data_lib
    from tfpar import recipes
    from tfpar.evaluation import evaluate
    from tfpar.loop import Trainer

    def say(message):
        print(f"[w{info.task_index}] {message}", flush=True)

    config = runpy.run_path(CONFIG)["get_config"]()
    splits = data_lib.load("corpus", seq_len=config.data.seq_len, seed=0)
    eval_data, eval_steps = data_lib.distribute_eval(strategy, splits.validation, args.eval_batch,
                                                     limit=args.eval_examples)
    say(f"{info.kind}, {info.replicas} replicas, {info.num_workers} workers; eval "
        f"{args.eval_examples} examples in {eval_steps} steps; tfpar from {os.path.dirname(tfpar.__file__)}")
    results, extra = {}, None
    for name in args.configs:
        started = time.perf_counter()
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = recipes.build_model(config, splits.info)
            optimizer = recipes.build_optimizer(config.optimizer, args.steps)
        compression = compression_for(name)
        trainer = Trainer(model, optimizer, recipes.SmoothedSparseCrossentropy(0.0), strategy=strategy,
                          steps_per_loop=args.steps_per_loop, compression=compression)
        if extra is None:
            extra = plans(model.trainable_variables)
        train_data = data_lib.distribute_train(strategy, splits.train, args.batch)
        phases = {"build_s": time.perf_counter() - started}
        t0 = time.perf_counter()
        wire = trainer.wire_bytes(train_data)
        phases["wire_bytes_trace_s"] = time.perf_counter() - t0
        wire["analytic_bytes_per_step"] = analytic_bytes(model.trainable_variables, compression.compressor,
                                                         compression.policy)
        iterator = iter(train_data)
        t0 = time.perf_counter()
        curve = [[0, evaluate(model, strategy, eval_data, eval_steps)["loss"]]]
        phases["eval_s"] = time.perf_counter() - t0
        per_step, train_losses, step = [], [], 0
        while step < args.steps:
            n = min(args.steps_per_loop, args.steps - step)
            t0 = time.perf_counter()
            train_losses.append(trainer.train_steps(iterator, n))
            per_step.append((time.perf_counter() - t0) / n)
            step += n
            if step % args.eval_every == 0 or step == args.steps:
                t0 = time.perf_counter()
                curve.append([step, evaluate(model, strategy, eval_data, eval_steps)["loss"]])
                phases["eval_s"] += time.perf_counter() - t0
                say(f"{name}: step {step} train {train_losses[-1]:.4f} val {curve[-1][1]:.4f} "
                    f"step {1000 * per_step[-1]:.0f} ms")
        timed = per_step[args.warmup_calls:] or per_step
        results[name] = {
            **wire,
            "step_time_s": statistics.median(timed),
            "step_time_mean_s": statistics.fmean(timed),
            "step_times_s": per_step,
            "first_call_s": per_step[0] * min(args.steps_per_loop, args.steps),
            "val_loss": curve,
            "final_val_loss": curve[-1][1],
            "train_loss": train_losses,
            "wall_s": time.perf_counter() - started,
            "phases_s": {**phases, "train_s": sum(per_step[i] * min(args.steps_per_loop, args.steps - i * args.steps_per_loop)
                                                  for i in range(len(per_step)))},
        }
        say(f"{name}: {wire['bytes_per_step']:,} B/step ({wire['ratio']:.1f}x), "
            f"median step {1000 * results[name]['step_time_s']:.0f} ms, val {curve[-1][1]:.4f}, "
            f"{results[name]['wall_s']:.0f} s {json.dumps({k: round(v, 1) for k, v in results[name]['phases_s'].items()})}")
        with open(args.result_file.replace("{task}", str(info.task_index)), "w") as f:
            json.dump({"task_index": info.task_index, "results": results, **extra}, f, indent=1)


# -- the orchestrator ----------------------------------------------------------------------

def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def teardown_link() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes its end of the veth pair, then the pair
        _sh("ip", "netns", "del", ns, check=False)


def setup_link(rate: str) -> None:
    teardown_link()
    a, b = NAMESPACES
    _sh("ip", "netns", "add", a)
    _sh("ip", "netns", "add", b)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, address in zip(NAMESPACES, VETH, ADDRESSES):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", "32kbit", "latency", "50ms")


def qdisc_stats() -> dict:
    return {ns: _sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout.strip()
            for ns, dev in zip(NAMESPACES, VETH)}


_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); got, t = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t is None: t = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - t, flush=True)
"""
_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
"""


def measure_link(megabytes: int = 50) -> dict:
    """Mbit/s of one TCP stream tfpA -> tfpB (and back), through the shaped veth pair."""
    out = {}
    for (src, dst), address in [((0, 1), ADDRESSES[1]), ((1, 0), ADDRESSES[0])]:
        sink = subprocess.Popen(["ip", "netns", "exec", NAMESPACES[dst], sys.executable, "-c", _SINK,
                                 address, str(PORT + 100)], stdout=subprocess.PIPE, text=True)
        try:
            sink.stdout.readline()
            subprocess.run(["ip", "netns", "exec", NAMESPACES[src], sys.executable, "-c", _SOURCE,
                            address, str(PORT + 100), str(megabytes)], check=True, timeout=120)
            got, seconds = sink.stdout.readline().split()
            sink.wait(timeout=30)
        finally:
            if sink.poll() is None:
                sink.kill()
        out[f"{NAMESPACES[src]}->{NAMESPACES[dst]}_mbit_s"] = int(got) * 8 / float(seconds) / 1e6
    return out


def _worker_args(args, result_file: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", f"--result-file={result_file}",
            f"--steps={args.steps}", f"--steps-per-loop={args.steps_per_loop}",
            f"--eval-every={args.eval_every}", f"--eval-examples={args.eval_examples}",
            f"--warmup-calls={args.warmup_calls}", f"--configs={','.join(args.configs)}"]


def _pump(stream, prefix: str, log) -> None:
    for line in iter(stream.readline, ""):
        log.write(f"{prefix} {line}")
        log.flush()
        if re.match(r"\[w\d\] ", line) or "Error" in line or "Traceback" in line:
            print(f"{prefix} {line}", end="", flush=True)


def run_cluster(link: str, args, workdir: str) -> dict:
    """Starts the 2 workers for `link`, waits for them; returns worker 0's results."""
    result_file = os.path.join(workdir, f"{link}_worker{{task}}.json")
    log_path = os.path.join(workdir, f"{link}.log")
    if link == "loopback":
        from tfpar.launch import cluster_spec
        cluster = cluster_spec(2)
        prefixes = [[], []]
    else:
        cluster = {"worker": [f"{address}:{PORT}" for address in ADDRESSES]}
        prefixes = [["ip", "netns", "exec", ns] for ns in NAMESPACES]
    processes, pumps = [], []
    with open(log_path, "w") as log:
        try:
            for index, prefix in enumerate(prefixes):
                env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                           TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
                process = subprocess.Popen(prefix + _worker_args(args, result_file), env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
                processes.append(process)
                thread = threading.Thread(target=_pump, args=(process.stdout, f"[{link}]", log), daemon=True)
                thread.start()
                pumps.append(thread)
            while True:
                codes = [p.poll() for p in processes]
                if any(c not in (None, 0) for c in codes):
                    raise RuntimeError(f"{link}: a worker exited with {codes}; see {log_path}")
                if all(c == 0 for c in codes):
                    break
                time.sleep(0.5)
        finally:
            for p in processes:  # only the process groups this function started
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
    with open(result_file.replace("{task}", "0")) as f:
        chief = json.load(f)
    with open(result_file.replace("{task}", "1")) as f:
        other = json.load(f)
    for name, row in chief["results"].items():  # both workers must have computed the same losses
        row["workers_agree"] = all(abs(a[1] - b[1]) < 1e-6 for a, b in
                                   zip(row["val_loss"], other["results"][name]["val_loss"]))
    chief["log"] = log_path
    return chief


def powersgd_arithmetic(rank: int = 4) -> dict:
    shapes = {"mlp up/down (128x512)": (128, 512), "attention q/k/v (128x[4x32])": (128, 128),
              "head project (128x256)": (128, 256), "token embedding (256x128)": (256, 128)}
    return {label: {"fp32_floats": n * m, "sent_floats": rank * (n + m), "ratio": n * m / (rank * (n + m))}
            for label, (n, m) in shapes.items()}


def table(results: dict) -> list[dict]:
    loop, shaped = results.get("loopback", {}), results.get("shaped", {})
    base = shaped or loop
    rows = []
    for name in CONFIGS:
        src = base.get(name) or loop.get(name)
        if src is None:
            continue
        row = {"config": name, "bytes_per_step": src["bytes_per_step"], "ratio": src["ratio"],
               "step_s_loopback": loop.get(name, {}).get("step_time_s"),
               "step_s_shaped": shaped.get(name, {}).get("step_time_s"),
               "final_val_loss": src["final_val_loss"],
               "final_val_loss_loopback": loop.get(name, {}).get("final_val_loss")}
        if shaped.get("none") and row["step_s_shaped"]:
            row["speedup_shaped"] = shaped["none"]["step_time_s"] / row["step_s_shaped"]
        if loop.get("none") and row["step_s_loopback"]:
            row["speedup_loopback"] = loop["none"]["step_time_s"] / row["step_s_loopback"]
        none = base.get("none") or loop.get("none")
        if none:
            row["gap_vs_none"] = (row["final_val_loss"] - none["final_val_loss"]) / none["final_val_loss"]
        rows.append(row)
    return rows


def goals(rows: list[dict]) -> dict:
    out = {}
    for row in rows:
        if row["config"] not in GOAL_CONFIGS:
            continue
        speed = row.get("speedup_shaped")
        out[row["config"]] = {
            f"bytes>={GOAL_RATIO:g}x": row["ratio"] >= GOAL_RATIO,
            f"speedup>={GOAL_SPEEDUP:g}x_on_shaped_link": None if speed is None else speed >= GOAL_SPEEDUP,
            f"val_loss_within_{GOAL_GAP:.0%}": abs(row.get("gap_vs_none", 1)) <= GOAL_GAP,
        }
    return out


def print_table(rows: list[dict]) -> None:
    def cell(value, fmt, unit, width):
        return ("-" if value is None else format(value, fmt) + unit).rjust(width)

    header = (f"{'config':<16} {'bytes/step':>10} {'ratio':>6} {'step lo':>8} {'step link':>9} "
              f"{'speedup':>7} {'val loss':>8} {'gap':>7} {'val lo':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        lo, link, gap = r["step_s_loopback"], r["step_s_shaped"], r.get("gap_vs_none")
        print(f"{r['config']:<16} {r['bytes_per_step']:>10,} {r['ratio']:>5.1f}x "
              f"{cell(lo and 1000 * lo, '.0f', 'ms', 8)} {cell(link and 1000 * link, '.0f', 'ms', 9)} "
              f"{cell(r.get('speedup_shaped'), '.2f', 'x', 7)} {r['final_val_loss']:>8.4f} "
              f"{cell(None if gap is None else 100 * gap + 0.0, '+.2f', '%', 7)} "
              f"{cell(r['final_val_loss_loopback'], '.4f', '', 7)}")


def plot(results: dict, rows: list[dict], path: str, rate: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes, ax_time) = plt.subplots(1, 3, figsize=(17, 5))
    curves = results.get("shaped") or results.get("loopback")
    for name, row in curves.items():
        steps, losses = zip(*row["val_loss"])
        ax_loss.plot(steps, losses, marker="o", ms=3, label=name, ls="--" if name.endswith("+emb") else "-")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("validation loss (nats/byte)")
    ax_loss.set_ylim(top=min(6.0, ax_loss.get_ylim()[1]))
    ax_loss.set_title("validation loss (fixed subset)")
    ax_loss.legend(fontsize=8)
    names = [r["config"] for r in rows]
    ax_bytes.bar(names, [r["bytes_per_step"] for r in rows], color="tab:blue")
    fp32 = next(iter(curves.values()))["fp32_bytes_per_step"]
    ax_bytes.axhline(fp32 / GOAL_RATIO, color="tab:red", ls=":", label=f"goal: fp32 / {GOAL_RATIO:g}")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("bytes per replica per step")
    ax_bytes.set_title("wire bytes (traced graph)")
    ax_bytes.legend(fontsize=8)
    width = 0.4
    xs = range(len(rows))
    for offset, key, label in [(-width / 2, "step_s_loopback", "loopback"),
                               (width / 2, "step_s_shaped", f"shaped link ({rate})")]:
        ax_time.bar([x + offset for x in xs], [1000 * (r[key] or 0) for r in rows], width, label=label)
    ax_time.set_xticks(list(xs), names)
    ax_time.set_ylabel("median step time (ms)")
    ax_time.set_title("step time, 2 workers")
    ax_time.legend(fontsize=8)
    for ax in (ax_bytes, ax_time):
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.suptitle("gpt_tiny, 2 workers (multi_worker_mirrored), global batch 32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--links", default="loopback,shaped", help="loopback, shaped or both")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--steps-per-loop", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-examples", type=int, default=512)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup-calls", type=int, default=2, help="tf.function calls left out of the timing")
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate of the shaped link")
    parser.add_argument("--connect-timeout", type=float, default=120.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if args.worker:
        return worker(args)

    links = [l.strip() for l in args.links.split(",") if l.strip()]
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tfpar_compression_")
    print(f"logs and per-worker results in {workdir}", flush=True)
    results, meta = {}, {"link": {}}
    started = time.perf_counter()

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    for link in links:
        t0 = time.perf_counter()
        if link == "shaped":
            if os.geteuid() != 0:
                print("shaped link skipped: needs root (ip netns, tc)", flush=True)
                continue
            try:
                setup_link(args.rate)
                meta["link"] = {"rate": args.rate, "namespaces": NAMESPACES, "addresses": ADDRESSES,
                                "qdisc": "tbf rate %s burst 32kbit latency 50ms on both veth ends" % args.rate,
                                **measure_link()}
                print(f"shaped link: {meta['link']}", flush=True)
                chief = run_cluster(link, args, workdir)
                meta["link"]["qdisc_stats_after"] = qdisc_stats()
            finally:
                teardown_link()
        else:
            chief = run_cluster(link, args, workdir)
        results[link] = chief["results"]
        meta.update(plans=chief["plans"], analytic_everything_compressed=chief["analytic_everything_compressed"])
        meta[f"{link}_wall_s"] = time.perf_counter() - t0

    rows = table(results)
    print_table(rows)
    verdict = goals(rows)
    print(json.dumps(verdict, indent=1))
    fp32 = next(iter(next(iter(results.values())).values()))["fp32_bytes_per_step"]
    with open(os.path.join(args.out, "compression.json"), "w") as f:
        json.dump({"model": "gpt_tiny", "workers": 2, "strategy": "multi_worker_mirrored",
                   "global_batch": args.batch, "steps": args.steps, "steps_per_loop": args.steps_per_loop,
                   "eval_every": args.eval_every, "eval_examples": args.eval_examples,
                   "warmup_calls_excluded": args.warmup_calls, "fp32_bytes_per_step": fp32,
                   "goals": {"ratio": GOAL_RATIO, "speedup_on_shaped_link": GOAL_SPEEDUP,
                             "val_loss_gap": GOAL_GAP, "met": verdict},
                   "table": rows, "powersgd_rank4_arithmetic": powersgd_arithmetic(4),
                   **meta, "results": results, "total_wall_s": time.perf_counter() - started}, f, indent=2)
    plot(results, rows, os.path.join(args.out, "compression.png"), args.rate)
    print(f"wrote {args.out}/compression.json and compression.png "
          f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
