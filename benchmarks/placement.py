"""Benchmark: pipeline parallelism of gpt_tiny on logical CPUs, 2 and 4 stages, M micro-batches.

    python benchmarks/placement.py --out=bench_out            # JSON + PNGs in bench_out/

Global batch 256 sequences of 128 bytes (--batch): with micro-batches of 32, each op is
big enough that the executor's per-op cost does not swamp it (at batch 32, M=8 units of 4
sequences ran ~1.7x slower per sequence than unsplit). The CPU is split into 4 logical
devices with intra_op=1 and inter_op=4 threads, so each op runs on one core and ops of
different stages can run at once: the stages overlap only as much as the schedule lets
them. For S in {2, 4} and M in {1, 2, 4, 8} (gpipe, balanced by parameters) it reports the
time of a whole training step (tfpar.Trainer with the pipeline; every setting is built and
warmed first, then all are timed in interleaved rounds and the median kept, since this VM
drifts by +-20% over minutes), the bubble measured from the recorded schedule (units timed
inside the graph) beside the theoretical (S - 1) / (M + S - 1), and the parameter bytes on
each device. The baseline is the same model unsplit on one device. A Gantt chart of each
measured schedule is written next to the JSON. Speed lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(4)

from tfpar.strategy import runtime  # noqa: E402

DEVICES = runtime.split_devices(4)

import keras  # noqa: E402

from tfpar import data as data_lib  # noqa: E402
from tfpar import placement  # noqa: E402
from tfpar.loop import Trainer  # noqa: E402
from tfpar.models import GPT  # noqa: E402
from tfpar.recipes import SmoothedSparseCrossentropy  # noqa: E402

SEQ = 128
BATCH = 32  # set from --batch in main


def gpt_tiny():
    return GPT(vocab_size=256, max_len=SEQ, dim=128, depth=2, heads=4)


def loss_share(denominator):
    loss = SmoothedSparseCrossentropy()

    def share(y, logits, w):
        return tf.reduce_sum(tf.cast(loss.call(y, logits), tf.float32) * w) / denominator
    return share


class Config:
    """One setting (unsplit, or S stages x M micro-batches): its trainer, data and timings."""

    def __init__(self, splits, initial, stages: int = 1, micro_batches: int = 1):
        self.stages, self.micro_batches, self.plan, self.pipe = stages, micro_batches, None, None
        keras.utils.set_random_seed(0)
        if stages == 1:
            model = gpt_tiny()
        else:
            self.plan = placement.balanced(gpt_tiny(), [f"/cpu:{i}" for i in range(stages)])
            with self.plan.scope():
                model = gpt_tiny()
            self.pipe = placement.Pipeline(model, self.plan, micro_batches=micro_batches,
                                           schedule="gpipe", record=True)
        model.set_weights(initial)
        self.trainer = Trainer(model, keras.optimizers.AdamW(1e-3), SmoothedSparseCrossentropy(),
                               placement=self.pipe, xla=False)
        self.iterator = iter(data_lib.distribute_train(tf.distribute.get_strategy(), splits.train, BATCH))
        self.times: list[float] = []

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        self.trainer.train_steps(self.iterator, steps)
        self.times.append((time.perf_counter() - start) / steps)

    def record(self, repeats: int, png: str) -> dict:
        """The measured schedule of one forward + backward (median bubble of `repeats`)."""
        x, y = next(self.iterator)[:2]
        w = tf.ones(tf.shape(y), tf.float32)

        @tf.function
        def one():  # returns the gradients too, or they are pruned from the measured graph
            loss, grads = self.pipe.forward_backward(x, y, w, loss_share(float(BATCH * SEQ)))
            return self.pipe.timings, loss, grads

        one()  # trace
        summaries = [placement.timeline.summarize(one()[0].numpy()) for _ in range(repeats)]
        placement.timeline.draw(one()[0].numpy(), png,
                                title=f"gpt_tiny, {self.stages} stages, M={self.micro_batches}:")
        return {"bubble": statistics.median(s["bubble"] for s in summaries),
                "bubble_theory": summaries[0]["bubble_theory"],
                "makespan_s": statistics.median(s["makespan_s"] for s in summaries),
                "busy_s": statistics.median(s["busy_s"] for s in summaries)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--batch", type=int, default=256, help="global batch (sequences of 128)")
    args = parser.parse_args()
    global BATCH
    BATCH = args.batch
    os.makedirs(args.out, exist_ok=True)
    splits = data_lib.text_corpus(SEQ)
    keras.utils.set_random_seed(0)
    reference = gpt_tiny()
    reference.build((None, SEQ))
    initial = reference.get_weights()

    configs = [Config(splits, initial)] + [
        Config(splits, initial, stages, m)
        for stages in map(int, args.stages.split(",")) for m in map(int, args.micro_batches.split(","))]
    for config in configs:  # trace and warm every setting first
        config.run(args.warmup)
        config.times.clear()
    for round_ in range(args.repeats):  # then time them side by side, round after round
        for config in configs:
            config.run(args.steps)
        print(f"round {round_}: " + ", ".join(f"S={c.stages} M={c.micro_batches} {c.times[-1] * 1000:.0f} ms"
                                             for c in configs), flush=True)
    baseline = statistics.median(configs[0].times)
    rows = []
    for config in configs[1:]:
        plan = config.plan
        total = sum(g.params for g in plan.groups)
        row = {"stages": config.stages, "micro_batches": config.micro_batches,
               "step_s": statistics.median(config.times), "step_s_rounds": config.times,
               **config.record(args.repeats, os.path.join(
                   args.out, f"pipeline_s{config.stages}_m{config.micro_batches}.png")),
               "param_bytes_per_device": {g.device: 4 * g.params for g in plan.groups},
               "largest_stage_share": max(g.params for g in plan.groups) / total,
               "plan": plan.table()}
        rows.append(row)
        print(f"S={row['stages']} M={row['micro_batches']}: {row['step_s'] * 1000:.1f} ms/step, bubble "
              f"{row['bubble']:.2f} (theory {row['bubble_theory']:.2f}), largest stage "
              f"{row['largest_stage_share']:.2f}", flush=True)
    for row in rows:
        first = next(r for r in rows if r["stages"] == row["stages"] and r["micro_batches"] == 1)
        row["speedup_vs_m1"] = first["step_s"] / row["step_s"]
        row["speedup_vs_unsplit"] = baseline / row["step_s"]
        # > 1: the same work took longer in total once stages overlapped (shared cores)
        row["busy_vs_m1"] = row["busy_s"] / first["busy_s"]
    result = {"model": "gpt_tiny", "seq_len": SEQ, "global_batch": BATCH, "schedule": "gpipe",
              "threads": {"intra_op": 1, "inter_op": 4}, "logical_cpus": len(DEVICES),
              "physical_cores": os.cpu_count(), "unsplit_step_s": baseline, "runs": rows}
    with open(os.path.join(args.out, "placement.json"), "w") as f:
        json.dump(result, f, indent=2)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for stages in sorted({r["stages"] for r in rows}):
        mine = [r for r in rows if r["stages"] == stages]
        ms = [r["micro_batches"] for r in mine]
        left.plot(ms, [r["step_s"] * 1000 for r in mine], "o-", label=f"{stages} stages")
        right.plot(ms, [r["bubble"] for r in mine], "o-", label=f"{stages} stages, measured")
        right.plot(ms, [r["bubble_theory"] for r in mine], "k--", alpha=0.4,
                   label=f"{stages} stages, (S-1)/(M+S-1)")
    left.axhline(baseline * 1000, color="grey", linestyle=":", label="unsplit, one device")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M")
        ax.legend(fontsize=8)
    left.set_ylabel("ms / step")
    right.set_ylabel("bubble fraction")
    fig.suptitle(f"gpt_tiny pipeline on logical CPUs ({os.cpu_count()} cores, intra_op=1)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "placement.png"), dpi=120)


if __name__ == "__main__":
    main()
