"""compression="auto": measure the link and the compute at start, pick what reaches quality soonest.

At `build` (under the strategy's scope, before any step) Auto times one float32 all-reduce
of every gradient (the link, as the strategy's own collectives see it) and one
forward + backward proxy of the model's matrices (each [n, m] kernel: a [tokens, n] x
[n, m] product and its two backward products), then predicts for each candidate

    time to quality = steps factor x (compute + link time x bytes / float32 bytes)

and becomes the candidate with the smallest prediction, printing one line that says what
and why (on every worker, whatever the log level). The steps factor is what a candidate costs in steps to reach the validation loss
that none reaches at the run's end (benchmarks/compression.py, gpt_wide, 2 workers):
none and fp16 1.0; powersgd(4) with a 10%-of-steps uncompressed start ended 4.8% above
none at 600 steps; given a 900-step run it reached none's final loss at step 800, 1.33x
none's steps (benchmarks/results/wide_100m_longer.json). A candidate that
needs more steps than the run has would never reach that loss in it, so only candidates
with a factor of at most 1 are picked: auto never trades the model for speed. Only
candidates that work with any Keras optimizer are considered (dgc and 1-bit Adam need
plain SGD; pick them by name). On a fast link none wins: compression only pays when the
link time is a large share of the step.

Example:
    >>> trainer = Trainer(model, optimizer, loss, strategy=strategy, compression=Auto())
    >>> trainer.aggregator.decision
    'fp16: link 2.060 s per float32 all-reduce vs compute 0.095 s per step; ...'
"""

from __future__ import annotations

import time
from typing import Sequence

import tensorflow as tf

from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import FP16, CompressionError, NoCompression
from tfpar.compression.policy import Policy
from tfpar.compression.powersgd import PowerSGD

STEPS_FACTOR = {"none": 1.0, "fp16": 1.0, "powersgd": 1.33}


def candidates(total_steps: int) -> dict:
    """name -> Compression, for a run of `total_steps` steps."""
    start = max(1, total_steps // 10)
    return {"none": Compression(NoCompression()), "fp16": Compression(FP16()),
            "powersgd": Compression(PowerSGD(4), Policy(warmup_steps=start))}


def choose(link_s: float, compute_s: float, ratios: dict) -> tuple[str, dict]:
    """(best name, predicted seconds per float32-equivalent step for each). `ratios`: name ->
    bytes sent / float32 bytes."""
    predicted = {name: STEPS_FACTOR[name] * (compute_s + link_s * ratio) for name, ratio in ratios.items()}
    within_the_run = [name for name in predicted if STEPS_FACTOR[name] <= 1.0]
    return min(within_the_run, key=lambda n: (predicted[n], n != "none")), predicted


def _median_seconds(run, repeats: int = 3) -> float:
    """Median wall seconds of `repeats` calls of `run`, after one untimed call (the trace)."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _time_all_reduce(strategy, size: int) -> float:
    """Seconds of one SUM all-reduce of `size` float32 (median of 3; a single one varied
    1.5x on a shaped link)."""
    @tf.function
    def reduce():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.ones([size])))

    return _median_seconds(lambda: tf.nest.map_structure(
        lambda t: t.numpy(), strategy.experimental_local_results(reduce())))


def _time_compute(variables: Sequence[tf.Variable], tokens: int) -> float:
    """Seconds of a forward + backward proxy: three [tokens, n] x [n, m] products per matrix."""
    shapes = [(int(v.shape[0]), int(v.shape.num_elements()) // int(v.shape[0]))
              for v in variables if v.shape.rank and v.shape.rank >= 2]

    # inputs are arguments: products of constants inside the function are folded by grappler
    # at trace time, which timed 1 ms for gpt_wide's 95 ms step
    inputs = [(tf.random.normal([tokens, n]), tf.random.normal([n, m])) for n, m in shapes]

    @tf.function
    def proxy(inputs):
        total = tf.constant(0.0)
        for x, w in inputs:
            y = tf.matmul(x, w)
            total += tf.reduce_sum(tf.matmul(y, w, transpose_b=True)) + tf.reduce_sum(tf.matmul(x, y, transpose_a=True))
        return total

    return _median_seconds(lambda: float(proxy(inputs)))


class Auto(Compression):
    """Measures at build, then is the chosen Compression (see module docstring)."""

    def __init__(self, total_steps: int = 600, tokens: int = 1024, link_s: float | None = None,
                 compute_s: float | None = None):
        super().__init__(NoCompression())
        self.total_steps, self.tokens = total_steps, tokens
        self.link_s, self.compute_s = link_s, compute_s
        self.chosen: Compression | None = None
        self.decision = ""

    def _build_state(self, variables: Sequence[tf.Variable]) -> None:
        strategy = tf.distribute.get_strategy()
        size = sum(int(v.shape.num_elements()) for v in variables)
        communicates = strategy.num_replicas_in_sync > 1 or getattr(strategy.extended, "_num_workers", 1) > 1
        link_s = self.link_s if self.link_s is not None else (
            _time_all_reduce(strategy, size) if communicates else 0.0)
        compute_s = self.compute_s if self.compute_s is not None else _time_compute(variables, self.tokens)
        options = candidates(self.total_steps)
        ratios, unusable = {}, {}
        for name, compression in options.items():
            try:
                compression.build(variables)
            except CompressionError as error:  # e.g. powersgd(4) on a model of thin matrices
                unusable[name] = str(error)
                continue
            ratios[name] = sum(compression.payload_bytes(variables).values()) / (4 * size)
        name, predicted = choose(link_s, compute_s, ratios)
        self.chosen = options[name]
        self.compressor, self.policy, self.plan = self.chosen.compressor, self.chosen.policy, self.chosen.plan
        self.paths, self.state = self.chosen.paths, self.chosen.state
        self.decision = (f"{name}: link {link_s:.3f} s per float32 all-reduce vs compute "
                         f"{compute_s:.3f} s per step; predicted s/step x steps factor: "
                         + ", ".join(f"{n} {p:.3f}" + (f" (needs {STEPS_FACTOR[n]:g}x the steps: left out)"
                                                      if STEPS_FACTOR[n] > 1 else "")
                                     for n, p in sorted(predicted.items(), key=lambda kv: kv[1]))
                         + "".join(f"; {n} cannot run on this model: {why}" for n, why in unusable.items()))
        print(f"compression=auto picked {self.decision}", flush=True)  # one line, whatever the log level

    def __call__(self, gradients, variables):
        return self.chosen(gradients, variables)

    def boundaries(self):
        return self.chosen.boundaries()

    def phase(self, step):
        return self.chosen.phase(step)

    def set_phase(self, phase):
        self.chosen.set_phase(phase)

    def checkpoint_items(self):
        return self.chosen.checkpoint_items()

    def state_variables(self):
        return self.chosen.state_variables()

    def payload_bytes(self, variables, phase="compressed"):
        return self.chosen.payload_bytes(variables, phase)

    def __repr__(self):
        return f"auto({self.chosen!r})" if self.chosen else "auto"
