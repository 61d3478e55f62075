"""Benchmark: pipeline parallelism of gpt_tiny on logical CPUs, 2 and 4 stages, M micro-batches.

    python benchmarks/placement.py --out=bench_out            # JSON + PNGs in bench_out/

The CPU is split into 4 logical devices with intra_op=1 and inter_op=4 threads, so each
op runs on one core and ops of different stages can run at once: the stages overlap
only as much as the schedule lets them. For S in {2, 4} and M in {1, 2, 4, 8} (gpipe,
balanced by parameters) it reports the time of a whole training step (tfpar.Trainer with
the pipeline), the bubble measured from the recorded schedule (units timed inside the
graph) beside the theoretical (S - 1) / (M + S - 1), and the parameter bytes on each
device. The baseline is the same model unsplit on one device. A Gantt chart of each
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

SEQ, BATCH = 128, 32


def gpt_tiny():
    return GPT(vocab_size=256, max_len=SEQ, dim=128, depth=2, heads=4)


def loss_share(denominator):
    loss = SmoothedSparseCrossentropy()

    def share(y, logits, w):
        return tf.reduce_sum(tf.cast(loss.call(y, logits), tf.float32) * w) / denominator
    return share


def step_seconds(trainer, iterator, warmup: int, steps: int, repeats: int) -> float:
    """Median seconds per optimizer step over `repeats` timed runs of `steps` steps."""
    trainer.train_steps(iterator, warmup)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.train_steps(iterator, steps)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def measure(stages: int, micro_batches: int, splits, initial, args, out: str) -> dict:
    keras.utils.set_random_seed(0)
    template = gpt_tiny()
    template.build((None, SEQ))
    plan = placement.balanced(template, [f"/cpu:{i}" for i in range(stages)])
    with plan.scope():
        model = gpt_tiny()
        model.build((None, SEQ))
    model.set_weights(initial)
    pipe = placement.Pipeline(model, plan, micro_batches=micro_batches, schedule="gpipe", record=True)
    trainer = Trainer(model, keras.optimizers.AdamW(1e-3), SmoothedSparseCrossentropy(), placement=pipe)
    iterator = iter(data_lib.distribute_train(tf.distribute.get_strategy(), splits.train, BATCH))
    seconds = step_seconds(trainer, iterator, args.warmup, args.steps, args.repeats)

    x, y = next(iterator)[:2]
    w = tf.ones(tf.shape(y), tf.float32)
    @tf.function
    def record():  # returns the gradients too, or they are pruned from the measured graph
        loss, grads = pipe.forward_backward(x, y, w, loss_share(float(BATCH * SEQ)))
        return pipe.timings, loss, grads

    record()  # trace
    summaries = [placement.timeline.summarize(record()[0].numpy()) for _ in range(args.repeats)]
    bubble = statistics.median(s["bubble"] for s in summaries)
    timings = record()[0].numpy()
    placement.timeline.draw(timings, os.path.join(out, f"pipeline_s{stages}_m{micro_batches}.png"),
                            title=f"gpt_tiny, {stages} stages, M={micro_batches}:")
    total = sum(g.params for g in plan.groups)
    return {"stages": stages, "micro_batches": micro_batches, "step_s": seconds,
            "bubble": bubble, "bubble_theory": summaries[0]["bubble_theory"],
            "param_bytes_per_device": {g.device: 4 * g.params for g in plan.groups},
            "largest_stage_share": max(g.params for g in plan.groups) / total,
            "plan": plan.table()}


def unsplit_seconds(splits, initial, args) -> float:
    keras.utils.set_random_seed(0)
    model = gpt_tiny()
    model.build((None, SEQ))
    model.set_weights(initial)
    trainer = Trainer(model, keras.optimizers.AdamW(1e-3), SmoothedSparseCrossentropy(), xla=False)
    iterator = iter(data_lib.distribute_train(tf.distribute.get_strategy(), splits.train, BATCH))
    return step_seconds(trainer, iterator, args.warmup, args.steps, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--stages", default="2,4")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    splits = data_lib.text_corpus(SEQ)
    keras.utils.set_random_seed(0)
    reference = gpt_tiny()
    reference.build((None, SEQ))
    initial = reference.get_weights()

    rows = []
    baseline = unsplit_seconds(splits, initial, args)
    print(f"unsplit, one device: {baseline * 1000:.1f} ms/step", flush=True)
    for stages in map(int, args.stages.split(",")):
        for m in map(int, args.micro_batches.split(",")):
            row = measure(stages, m, splits, initial, args, args.out)
            rows.append(row)
            print(f"S={stages} M={m}: {row['step_s'] * 1000:.1f} ms/step, bubble {row['bubble']:.2f} "
                  f"(theory {row['bubble_theory']:.2f}), largest stage {row['largest_stage_share']:.2f}",
                  flush=True)
    for row in rows:
        first = next(r for r in rows if r["stages"] == row["stages"] and r["micro_batches"] == 1)
        row["speedup_vs_m1"] = first["step_s"] / row["step_s"]
        row["speedup_vs_unsplit"] = baseline / row["step_s"]
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
