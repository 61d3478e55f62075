"""Benchmark: pipeline schedules of a 4-block GPT on logical CPUs, side by side.

    python benchmarks/placement.py            # benchmarks/results/schedules/: JSON, PNGs, one GIF
    python benchmarks/placement.py --out=/tmp/b --stages=2 --micro-batches=4 --batch=32 --rounds=1

For each schedule (gpipe, 1f1b, interleaved with v = 2, zb-h1, zb-v), S in {2, 4} devices and M in
{4, 8} micro-batches it traces one forward + backward step with the units timed inside
the graph (`Pipeline(record=True)`) and reports:
- ms/step: wall time of that step (the optimizer update, the same for every schedule, is
  left out); every setting is traced and warmed first, then all are timed in interleaved
  rounds and the median kept (this machine drifts, and is shared);
- the bubble measured from the recorded units, beside its theory at equal unit durations
  (`Pipeline.bubble_theory()`) and beside the same schedule replayed with each unit's
  measured median duration (`schedules.simulate`: what the order alone costs on these
  unit times, without the executor's gaps);
- activation memory: per device, the peak bytes of saved activations, counted from the
  traced step (`pipe.activation_bytes`).
zb-h1 and zb-v run twice: "zb-h1 (F=B=W)" in the order built for equal unit times, and
"zb-h1" in the order built for the unit times that run measured (`Pipeline(unit_times=...)`,
a profile-guided order); their theory for the goals is that order replayed at those times,
since equal times are not what this model's stages take.
It writes a Gantt chart per setting and ONE animated GIF of the schedules at S=2, M=8 (or
the first S and the largest M asked for) playing side by side on one clock, from measured
timings. A GPU, where there is one, is split into 2 logical GPUs (S = 2 only; see
benchmarks/gpu_check.sh). The CPU is split into 4 logical devices with intra_op=1 and one
inter-op thread per pipeline device (the largest S asked for; `--inter-op`), so stages
overlap only as the schedule lets them. Plans are balanced by counted FLOPs, or by measured
seconds (`--cost=seconds`: what this CPU takes per stage, forward + backward).
Speed lives here, never in tests.

`--model=wait` is the regime where devices do not share compute, as GPUs do not: a chain of
16 layers whose forward, input-gradient and weight-gradient passes each wait `--unit-ms` ms
(no arithmetic), one wait at a time per device (a lock per device: a GPU stream runs one
kernel at a time). Logical CPUs then behave like separate devices, and what the table
measures is the schedule and the executor alone: the orders, their dependencies, the
executor's gaps. On the real model (`--model=gpt`, the default) four logical devices share
two cores, so a unit alone runs 2-3x faster than beside three others and fills the warm-up
and cool-down that the theory counts as idle.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfpar.strategy import runtime  # noqa: E402


WAIT_LAYERS = 16  # --model=wait: 8 per group at S = 2, 4 at S = 4, 2 per chunk at S = 4, v = 2


def inter_op_threads(argv: list[str]) -> int:
    """`--inter-op`, else the largest S asked for: one inter-op thread per pipeline device.

    With 4 threads for 2 devices on 2 cores, the same plan's units ran unevenly (device 1's
    forward 163 ms, device 0's 134; 5% more work a step on device 1), and zero-bubble orders
    need balanced devices. With 2 threads both forwards took 113 ms and the devices' work
    agreed within 0.5% (benchmarks/results/schedules/README.md, "One inter-op thread per device"). Read before
    TensorFlow starts, so from the command line itself."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--stages", default="2,4")
    early.add_argument("--inter-op", type=int, default=0)
    early.add_argument("--model", default="gpt")
    known, _ = early.parse_known_args(argv)
    if known.inter_op < 0:
        early.error(f"--inter-op={known.inter_op}: give a thread count >= 1 (0: one per pipeline device)")
    devices = max(int(s) for s in known.stages.split(","))
    # waiting threads take no core, and one unit may hold many: a W unit's waits all become
    # ready at once and each holds a thread while it queues on its device's lock. The wait
    # model gets one thread per layer's wait beside the others' units: no device waits for one.
    return known.inter_op or (WAIT_LAYERS + 4 * devices if known.model == "wait" else devices)


# a GPU is split in 2 (the GPU run: S = 2), the CPU in 4 that must share its cores:
# one thread per op, and one inter-op thread per pipeline device so the stages overlap
KIND = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
THREADS = {"intra_op": 1, "inter_op": inter_op_threads(sys.argv[1:])} if KIND == "CPU" else None
if THREADS:
    tf.config.threading.set_intra_op_parallelism_threads(THREADS["intra_op"])
    tf.config.threading.set_inter_op_parallelism_threads(THREADS["inter_op"])
DEVICES = runtime.split_devices(2 if KIND == "GPU" else 4, gpu_memory_mb=16 << 10)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import placement  # noqa: E402
from tfpar.models import GPT  # noqa: E402
from tfpar.models.chain import Chain  # noqa: E402
from tfpar.placement import costs, timeline  # noqa: E402

VOCAB = 256
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
PROFILED = ("zb-h1", "zb-v")  # orders built for the unit times they are given


def gpt(dim: int = 128, depth: int = 4, seq: int = 128):
    """Depth 4: 10 stages, enough for 4 devices x 2 chunks; gpt_tiny's width by default.
    Deeper models cut finer, so the groups balance better."""
    return GPT(vocab_size=VOCAB, max_len=seq, dim=dim, depth=depth, heads=4)


_DEVICE_LOCKS = collections.defaultdict(threading.Lock)


def waited(x: tf.Tensor, seconds: float) -> tf.Tensor:
    """`x`, after `seconds` of waiting on the device this op is placed on, one wait at a time
    per device. Stateless (no automatic control dependencies across stages)."""
    lock = _DEVICE_LOCKS[tf.identity(x).device]  # the device scope it is traced under

    def wait(value):
        with lock:
            time.sleep(seconds)
        return value

    y = tf.numpy_function(wait, [x], x.dtype, stateful=False)
    y.set_shape(x.shape)
    return y


class Wait(keras.layers.Layer):
    """y = x * scale, whose forward, input gradient (B) and weight gradient (W) each wait
    `seconds`: a unit of known length that takes no core. W waits after B's wait, as the
    weight gradient reads the output gradient that B has passed through."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def compute_output_shape(self, shape):
        return shape

    def call(self, x):
        seconds = self.seconds

        @tf.custom_gradient
        def run(x, scale):
            def grad(dy):
                passed = waited(dy, seconds)
                return passed * scale, tf.reduce_sum(waited(passed, seconds) * x, axis=0)
            return waited(x, seconds) * scale, grad

        return run(x, tf.convert_to_tensor(self.scale))


def wait_model(unit_ms: float):
    """A Dense layer (so the first Wait has an input gradient too) and WAIT_LAYERS Waits;
    with its cost per stage (the Dense counts for nothing)."""
    layers = [keras.layers.Dense(8, name="in")] + [Wait(unit_ms / 1000, name=f"wait{i}")
                                                  for i in range(WAIT_LAYERS)]
    model = Chain(layers, (None, 8), name="wait_chain")
    return model, {"in": 0.0, **{f"wait{i}": 1.0 for i in range(WAIT_LAYERS)}}


class Setting:
    """One schedule x S x M: its pipeline, traced step and measurements."""

    def __init__(self, model, cost, batch, schedule: str, stages: int, micro_batches: int,
                 unit_times=None):
        self.schedule, self.stages, self.micro_batches = schedule, stages, micro_batches
        self.profiled = unit_times is not None
        chunks = 2 if schedule in ("interleaved", "zb-v") else 1
        layout = "v" if schedule == "zb-v" else "round_robin"
        self.plan = placement.balanced(model, DEVICES[:stages], cost=cost, chunks=chunks, layout=layout)
        self.pipe = placement.Pipeline(model, self.plan, micro_batches=micro_batches,
                                       schedule=schedule, record=True, unit_times=unit_times)
        x, y = batch
        denominator = float(np.prod(y.shape))

        def share(y_part, logits, _):
            values = tf.keras.losses.sparse_categorical_crossentropy(y_part, logits, from_logits=True)
            return tf.reduce_sum(values) / denominator

        @tf.function
        def step():  # returns the gradients too, or they are pruned from the measured graph
            loss, grads = self.pipe.forward_backward(x, y, None, share)
            return self.pipe.timings, loss, grads

        self.step, self.times, self.timings = step, [], []

    @property
    def label(self) -> str:
        """zb-h1 is ordered for its measured unit times; "zb-h1 (F=B=W)" is the order for
        equal times, kept beside it to show what profiling buys."""
        return self.schedule if self.profiled or self.schedule not in PROFILED else f"{self.schedule} (F=B=W)"

    @property
    def name(self) -> str:
        return f"{self.label} S={self.stages} M={self.micro_batches}"

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            timings = self.step()[0]
        self.times.append((time.perf_counter() - start) / steps)
        self.timings.append(timings.numpy())

    def row(self, out: str) -> dict:
        measured = [timeline.summarize(t, self.pipe.bubble_theory()) for t in self.timings]
        typical = self.timings[len(self.timings) // 2]
        png = os.path.join(out, f"pipeline_{self.label.split()[0]}{'' if self.label == self.schedule else '_equal'}_s{self.stages}_m{self.micro_batches}.png")
        timeline.draw(typical, png, title=f"{self.name}:", theory=self.pipe.bubble_theory())
        return {"schedule": self.label, "stages": self.stages, "micro_batches": self.micro_batches,
                "chunks": self.plan.chunks, "step_ms": 1000 * statistics.median(self.times),
                "step_ms_rounds": [1000 * t for t in self.times],
                "bubble": float(statistics.median(m["bubble"] for m in measured)),
                "bubble_theory": self.pipe.bubble_theory(),
                "bubble_simulated": float(self._simulated(typical)),
                "unit_ms": {f"{k}{d}": 1000 * v for (k, d), v in sorted(timeline.unit_times(typical).items())},
                # units beside another device's over units alone (median durations): how much
                # a device alone gains from the cores the others leave idle (replays ignore it)
                "alone_speedup": timeline.alone_speedup(typical),
                "timings": typical.tolist(),  # the drawn step: device, micro-batch, kind, start, end, group
                "activation_bytes": {str(k): v for k, v in self.pipe.activation_bytes.items()},
                "activation_peak_bytes": max(v for k, v in self.pipe.activation_bytes.items()
                                             if isinstance(k, int)),
                "gantt": os.path.basename(png)}

    def _simulated(self, timings) -> float:
        return self.pipe.bubble_replayed(timeline.unit_times(timings))


def goals(rows: list[dict]) -> dict:
    """The issue's goals, checked on this run's numbers. Each row's bubble beside its theory
    (equal unit times), and beside its order replayed at the unit times it measured (the
    prediction for unequal units: a profiled zero-bubble order is built for those)."""
    def find(schedule, stages, m):
        return next((r for r in rows if (r["schedule"], r["stages"], r["micro_batches"]) == (schedule, stages, m)), None)

    def within(key):
        return {f"{r['schedule']} S={r['stages']} M={r['micro_batches']}": bool(abs(r["bubble"] - r[key]) <= 0.05)
                for r in rows}

    result = {"bubble_within_5_points_of_theory": within("bubble_theory"),
              "bubble_within_5_points_of_replay": within("bubble_simulated")}
    base = find("1f1b", 2, 8)
    for schedule, limit in (("zb-h1", 0.5), ("interleaved", 0.6)):
        other = find(schedule, 2, 8)
        if base and other and base["bubble"] > 0:
            ratio = other["bubble"] / base["bubble"]
            result[f"{schedule}_vs_1f1b_bubble_S2_M8"] = {"ratio": float(ratio), "goal": limit, "met": bool(ratio <= limit)}
    return result


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r['schedule']}\nS{r['stages']} M{r['micro_batches']}" for r in rows]
    xs = np.arange(len(rows))
    left.bar(xs - 0.2, [r["bubble"] for r in rows], 0.4, label="measured")
    left.bar(xs + 0.2, [r["bubble_theory"] for r in rows], 0.4, label="theory (equal units)")
    left.set_ylabel("bubble fraction")
    right.bar(xs, [r["activation_peak_bytes"] / 2**20 for r in rows])
    right.set_ylabel("peak saved activations, largest device (MiB)")
    for ax in (left, right):
        ax.set_xticks(xs, labels, fontsize=6)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    """The command line (see --help)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/schedules")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--micro-batches", default="4,8")
    parser.add_argument("--batch", type=int, default=128, help="global batch (sequences of --seq tokens)")
    parser.add_argument("--dim", type=int, default=128, help="model width (matmuls dominate from ~384)")
    parser.add_argument("--seq", type=int, default=128,
                        help="tokens per sequence (short and wide: matrix products dominate)")
    parser.add_argument("--depth", type=int, default=4, help="blocks (2 stages each, plus embed and head)")
    parser.add_argument("--cost", default="flops", choices=("flops", "seconds"),
                        help="balance the stages by counted FLOPs or by measured seconds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inter-op", type=int, default=0,
                        help="CPU inter-op threads (default: the largest --stages S; 16 + 4 S for "
                             "--model=wait; read at import)")
    parser.add_argument("--model", default="gpt", choices=("gpt", "wait"),
                        help="gpt: the real model; wait: units of --unit-ms that take no core "
                             "(devices that do not share compute, as GPUs)")
    parser.add_argument("--unit-ms", type=float, default=10.0,
                        help="--model=wait: each layer's forward, B and W wait this long")
    args = parser.parse_args()
    too_many = [s for s in map(int, args.stages.split(",")) if s > len(DEVICES)]
    if too_many:
        parser.error(f"--stages={args.stages}: {too_many} more than the {len(DEVICES)} logical {KIND}s "
                     "here (a GPU is split in 2: use --stages=2)")
    return args


def workload(args: argparse.Namespace) -> tuple:
    """(model, stage costs, one global batch, a description) for --model."""
    rng = np.random.RandomState(0)
    if args.model == "wait":
        model, cost = wait_model(args.unit_ms)
        batch = (tf.constant(rng.normal(size=(args.batch, 8)).astype("float32")),
                 tf.constant(rng.randint(0, 8, size=args.batch).astype("int32")))
        return model, cost, batch, (f"{WAIT_LAYERS} Wait layers after a Dense: forward, B and W each wait "
                                    f"{args.unit_ms:g} ms per layer, one wait at a time per device (no arithmetic)")
    model = gpt(args.dim, args.depth, args.seq)
    tokens = rng.randint(0, VOCAB, size=(args.batch, args.seq + 1)).astype("int32")
    batch = (tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:]))
    cost = costs.flops(model, batch[0][:8]) if args.cost == "flops" else costs.seconds(model, batch[0][:16])
    return model, cost, batch, f"GPT depth {args.depth}, dim {args.dim}, 4 heads, vocab 256"


def timed_settings(args: argparse.Namespace, model, cost, batch) -> list[Setting]:
    """Every schedule x stages x micro-batches setting (with the profiled schedules' twins
    ordered for measured unit times), traced and warmed, then timed side by side."""
    settings = [Setting(model, cost, batch, schedule, stages, m)
                for stages in map(int, args.stages.split(",")) for m in map(int, args.micro_batches.split(","))
                for schedule in args.schedules.split(",")
                if (schedule != "interleaved" or m % stages == 0)
                and (schedule not in ("interleaved", "zb-v") or 2 * stages <= len(model.stages()))]
    for setting in list(settings):  # trace and warm every setting first
        setting.run(args.warmup)
        if setting.schedule in PROFILED:  # and its twin ordered for the unit times just measured
            twin = Setting(model, cost, batch, setting.schedule, setting.stages, setting.micro_batches,
                           unit_times=timeline.unit_times(setting.timings[-1]))
            twin.run(args.warmup)
            twin.times.clear(), twin.timings.clear()
            settings.insert(settings.index(setting) + 1, twin)
            print(f"traced {twin.name}, unit times {twin.pipe.unit_times}", flush=True)
        setting.times.clear(), setting.timings.clear()
        print(f"traced {setting.name}", flush=True)
    for round_ in range(args.rounds):  # then time them side by side, round after round
        for setting in settings:
            setting.run(args.steps)
        print(f"round {round_}: " + ", ".join(f"{s.name} {s.times[-1] * 1000:.0f} ms" for s in settings), flush=True)
    return settings


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['schedule']:>11} S={r['stages']} M={r['micro_batches']}: {r['step_ms']:7.1f} ms/step, bubble "
              f"{r['bubble']:.3f} (theory {r['bubble_theory']:.3f}, replayed {r['bubble_simulated']:.3f}), "
              f"peak activations {r['activation_peak_bytes'] / 2**20:.1f} MiB, units alone faster by "
              + ", ".join(f"{k} {v:.2f}x" for k, v in r["alone_speedup"].items()), flush=True)


def draw(args: argparse.Namespace, settings: list[Setting], rows: list[dict]) -> None:
    """The animated timeline of one stages x micro-batches cell (S=2, M=8 where run) and
    the step-time plot."""
    shown_s, shown_m = rows[0]["stages"], max(r["micro_batches"] for r in rows if r["stages"] == rows[0]["stages"])
    if any(r["stages"] == 2 and r["micro_batches"] == 8 for r in rows):
        shown_s, shown_m = 2, 8
    shown = [s for s in settings if (s.stages, s.micro_batches) == (shown_s, shown_m)]
    timeline.animate({s.label: s.timings[len(s.timings) // 2] for s in shown},
                     os.path.join(args.out, "pipeline_schedules.gif"),
                     title=(f"{args.depth}-block GPT (dim {args.dim})" if args.model == "gpt" else "Wait layers")
                     + f" on {shown_s} logical {KIND}s, M={shown_m}, measured",
                     theories={s.label: s.pipe.bubble_theory() for s in shown})
    plot(rows, os.path.join(args.out, "placement.png"))


def main() -> None:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, cost, batch, described = workload(args)
    settings = timed_settings(args, model, cost, batch)
    rows = [s.row(args.out) for s in settings]
    print_rows(rows)
    draw(args, settings, rows)
    result = {"model": described, "seq_len": args.seq, "global_batch": args.batch,
              "balanced_by": args.cost if args.model == "gpt" else "layer count (equal waits)",
              "step": "forward + backward (no optimizer update)",
              "threads": THREADS or "TensorFlow's defaults",
              "logical_devices": len(DEVICES),
              "device_kind": KIND, "physical_cores": os.cpu_count(), "gif": "pipeline_schedules.gif",
              "goals": goals(rows), "runs": rows}
    with open(os.path.join(args.out, "placement.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["goals"], indent=1), flush=True)


if __name__ == "__main__":
    main()
