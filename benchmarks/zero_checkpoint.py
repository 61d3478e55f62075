"""Benchmark: host memory and time of one ZeRO checkpoint save per worker, before and after
the checkpoint was written one partition per worker.

    python benchmarks/zero_checkpoint.py --out=benchmarks/results/sharding     # JSON + PNG

gpt_small (tfpar.models.GPT.from_preset("small", vocab_size=256): 10.9 M parameters),
AdamW, Trainer(shard="optimizer"), multi_worker_mirrored with 2 worker processes on
loopback (tfpar.launch), one replica each. After one training step (so the slots are not
zero) each worker saves the same state several times, the two ways alternating:

- before: the code at git commit 4cd7a0f (tfpar/zero/checkpoint.py's PartitionValue and
  tfpar/checkpoints.py's save, copied below as `Before*`): every slot all-gathered across
  the workers and put together on every worker, which writes it whole (the chief to the
  checkpoint, the other to a scratch directory that is removed);
- after: tfpar's Checkpoints now: each worker writes its own slices to its own file, one
  barrier, the chief merges them into its checkpoint (tfpar.zero.files).

Memory: the growth of the process's resident set during the save: the kernel's peak
(VmHWM) is reset to the current resident set (`echo 5 > /proc/self/clear_refs`) right
before the save, and VmHWM - VmRSS(before) read right after. TensorFlow's CPU allocator
(oneDNN's pool) keeps what it freed, so a second save would show no growth at all: the
workers use the system allocator (TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1), and glibc's malloc
is told to mmap every block of 128 KiB or more and trim at once (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_), so each save's peak is its own. tracemalloc would miss
TensorFlow's buffers. One warm-up save of each kind is printed (WARMUP) but not recorded.

The run refuses to start (exit 3) while the 1-minute load average is above --max-load
(default 2.5): timings on a loaded machine are not comparable. Nothing here is asserted
in tests. Writes zero_checkpoint.json and zero_checkpoint.png under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MIB = 2 ** 20
KINDS = ("before", "after")


# -- the measurement ------------------------------------------------------------------------

def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measured(save) -> dict:
    """Runs `save()`; the resident-set growth at its peak and its wall time."""
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    started = time.perf_counter()
    save()
    seconds = time.perf_counter() - started
    return {"peak_growth_mib": (status_kib("VmHWM") - before) / 1024, "rss_before_mib": before / 1024,
            "seconds": seconds}


# -- before: the code at git commit 4cd7a0f, copied -------------------------------------------

def before_view(sharded):
    """The checkpoint node tfpar.zero.checkpoint.optimizer_view made at 4cd7a0f: each slot a
    PartitionValue saved whole (the all-gather, then its rows put together)."""
    import keras
    import tensorflow as tf

    from tfpar.compression import replica_state
    from tfpar.strategy import private_api

    class BeforePartitionValue(tf.__internal__.tracking.Trackable):
        def __init__(self, variable, index, layout, ranks):
            self.variable, self.index, self.layout, self.ranks = variable, index, layout, ranks
            self._gather = None

        def _serialize_to_tensors(self):
            variable = _tf_variable(self.variable)
            first = variable.values[0] if isinstance(variable, tf.distribute.DistributedValues) else variable
            host = tf.DeviceSpec.from_string(first.device or "/device:CPU:0").replace(
                device_type="CPU", device_index=0).to_string()
            return {"VARIABLE_VALUE": private_api.save_spec(lambda: self._whole(host), variable.dtype, host)}

        def _whole(self, host):
            variable = _tf_variable(self.variable)
            with tf.device(host):
                if not isinstance(variable, tf.distribute.DistributedValues):
                    rows = tf.convert_to_tensor(variable)[None]
                elif len(variable.values) == variable.distribute_strategy.num_replicas_in_sync:
                    rows = replica_state.stacked(variable)
                else:
                    if self._gather is None:
                        self._gather = replica_state.gathered(variable)
                    rows = self._gather()
                by_rank = sorted(self.ranks, key=self.ranks.get)
                return self.layout.unrows(tf.gather(rows, by_rank), [self.index])[0]

    def _tf_variable(variable):
        return variable.value if isinstance(variable, keras.Variable) else variable

    class Children(tf.__internal__.tracking.Trackable):
        def __init__(self, children):
            for name, child in children.items():
                self._track_trackable(child, name)

    shard, layout, ranks = sharded.shard, sharded.layout, sharded._ranks  # pylint: disable=protected-access
    slots = {}
    for k, variable in enumerate(shard.clone.variables):
        if k < shard.own_variables:
            continue
        index = shard.slot_of.get(k)
        slots[str(k)] = variable if index is None else BeforePartitionValue(variable, index, layout, ranks)
    counter = {"_iterations": shard.base._iterations}  # pylint: disable=protected-access
    trainable = {"_trainable_variables": Children({str(i): v for i, v in enumerate(shard.variables)})}
    return Children({**counter, **trainable, "_variables": Children(slots)})


def before_save(model, view, directory: str, step: int, is_chief: bool) -> None:
    """tfpar/checkpoints.py's save at 4cd7a0f: every worker saves, the chief to the real
    directory, the others to a scratch directory removed straight away."""
    import tensorflow as tf

    weights = tf.train.Checkpoint(**{f"w{i}": v.value for i, v in enumerate(model.weights)})
    checkpoint = tf.train.Checkpoint(model=model, optimizer=view, model_weights=weights)
    if is_chief:
        tf.train.CheckpointManager(checkpoint, directory, 3).save(checkpoint_number=step)
        return
    scratch = tempfile.mkdtemp(prefix="tfpar_ckpt_")
    try:
        tf.train.CheckpointManager(checkpoint, scratch, 1).save(checkpoint_number=step)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- one worker ---------------------------------------------------------------------------------

def worker(args) -> None:
    import tfpar

    strategy = tfpar.create_strategy("multi_worker_mirrored", connect_timeout_s=120)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar.checkpoints import Checkpoints
    from tfpar.loop import Trainer
    from tfpar.models import GPT
    from tfpar.recipes import SmoothedSparseCrossentropy

    info = tfpar.describe(strategy)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = GPT.from_preset("small", vocab_size=256)
        optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.1, global_clipnorm=1.0)
    trainer = Trainer(model, optimizer, SmoothedSparseCrossentropy(), strategy=strategy, shard="optimizer",
                      steps_per_loop=1)
    rng = np.random.RandomState(0)
    x = rng.randint(0, 256, size=(args.batch, 256)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, np.roll(x, -1, 1))).repeat().batch(args.batch)
    trainer.fit(strategy.experimental_distribute_dataset(data), steps=1)

    workdir = args.workdir
    after = Checkpoints(os.path.join(workdir, "after"), info.is_chief, model=model, optimizer=optimizer)
    view = before_view(trainer._sharded)  # pylint: disable=protected-access
    saves = {"after": lambda step: after.save(step),
             "before": lambda step: before_save(model, view, os.path.join(workdir, "before", "checkpoints"),
                                                step, info.is_chief)}
    state_mib = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) * 2 / MIB  # m and v
    for kind in KINDS:  # warm-up: traced functions, first allocations
        row = {"warmup": True, "kind": kind, "task": info.task_index, **measured(lambda: saves[kind](0))}
        print("WARMUP " + json.dumps(row), flush=True)
    for round_ in range(args.rounds):
        for kind in KINDS[round_ % 2:] + KINDS[:round_ % 2]:  # each kind first in turn
            row = {"round": round_, "kind": kind, "task": info.task_index, "chief": info.is_chief,
                   "adam_state_whole_mib": state_mib, **measured(lambda: saves[kind](round_ + 1))}
            print("RESULT " + json.dumps(row), flush=True)


# -- the driver --------------------------------------------------------------------------------

def launch(args) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix="tfpar_zero_ckpt_")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "tfpar.launch", "--workers", str(args.workers), "--", sys.executable,
               os.path.abspath(__file__), "--worker", f"--workdir={workdir}", f"--rounds={args.rounds}",
               f"--batch={args.batch}"]
    env = {**os.environ, "PYTHONPATH": root, "TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1",
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env, cwd=root)
    finally:
        sizes = {kind: _checkpoint_bytes(os.path.join(workdir, kind, "checkpoints"), args.rounds) for kind in KINDS}
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode or not rows:
        raise RuntimeError(done.stdout[-4000:] + done.stderr[-4000:])
    return rows, sizes


def _checkpoint_bytes(directory: str, step: int) -> dict:
    """The files of checkpoint `step` and their sizes (the last one written)."""
    if not os.path.isdir(directory):
        return {}
    return {f: os.path.getsize(os.path.join(directory, f)) for f in sorted(os.listdir(directory))
            if f.startswith(f"ckpt-{step}.")}


def summary(rows: list[dict]) -> dict:
    """kind -> task -> medians of the recorded rounds."""
    found = {}
    for kind in KINDS:
        for task in sorted({r["task"] for r in rows}):
            mine = [r for r in rows if r["kind"] == kind and r["task"] == task]
            found.setdefault(kind, {})[f"worker-{task}"] = {
                key: statistics.median(r[key] for r in mine) for key in ("peak_growth_mib", "seconds")}
    return found


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = results["median"]
    tasks = sorted(medians["before"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    width = 0.38
    for offset, kind in ((-width / 2, "before"), (width / 2, "after")):
        left.bar([i + offset for i in range(len(tasks))], [medians[kind][t]["peak_growth_mib"] for t in tasks],
                 width, label=kind)
        right.bar([i + offset for i in range(len(tasks))], [medians[kind][t]["seconds"] for t in tasks],
                  width, label=kind)
    left.axhline(results["adam_state_whole_mib"], color="black", linestyle="--", linewidth=0.8,
                 label="Adam's m + v, whole")
    left.set_ylabel("resident-set growth during one save (MiB)")
    right.set_ylabel("one save (s)")
    for axis in (left, right):
        axis.set_xticks(range(len(tasks)), tasks)
        axis.legend(fontsize=8)
    fig.suptitle("gpt_small, AdamW, ZeRO-1 on 2 worker processes: one checkpoint save (medians)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/sharding")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="global batch of the one training step")
    parser.add_argument("--max-load", type=float, default=2.5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    load = os.getloadavg()
    if load[0] > args.max_load:
        print(f"load average {load[0]:.2f} > {args.max_load}: not measuring on a loaded machine; "
              "wait and run again", file=sys.stderr)
        sys.exit(3)
    rows, sizes = launch(args)
    load_after = os.getloadavg()
    import tensorflow as tf  # only for its version, after the workers ran

    results = {"model": "gpt_small (GPT.from_preset('small', vocab_size=256))",
               "optimizer": "AdamW(1e-3, weight_decay=0.1, global_clipnorm=1.0), shard='optimizer'",
               "strategy": f"multi_worker_mirrored, {args.workers} worker processes on loopback, 1 replica each",
               "adam_state_whole_mib": rows[0]["adam_state_whole_mib"], "rounds": args.rounds,
               "load_average_before": load, "load_average_after": load_after,
               "checkpoint_bytes_on_disk": sizes, "cpu_count": os.cpu_count(),
               "tensorflow": tf.__version__, "rows": rows, "median": summary(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "zero_checkpoint.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(args.out, "zero_checkpoint.png"))
    print(json.dumps(results["median"], indent=2))
    print("load average before/after:", load, load_after)


if __name__ == "__main__":
    main()
