"""compression="auto": measure the link and the compute at start, pick what reaches quality soonest.

The quality is the validation loss the uncompressed run (`none`) reaches at the run's end.
For each candidate Auto predicts the seconds to reach it, per step of none,

    steps factor x (compute x (1 + overhead) + latency x exchanges per step
                    + (link - latency) x bytes ratio)

and becomes the candidate with the smallest prediction. The link (a float32 all-reduce of
every gradient), its latency and the compute are timed at build; the bytes ratio (link
bytes over the run to quality / float32's) is counted from the candidate's own plan; the
rest was measured (benchmarks/results/, gpt_wide, 2 workers, AdamW, one run each;
benchmarks/results/compression/README.md):

- none: factor 1, overhead 0, any optimizer: the reference.
- fp16: factor 1.0, overhead 0.47, any optimizer. time_to_quality.json, 1gbit_w2 (auto picked
  fp16): 2.0264 at step 600 against none's 2.0272 (its rounding cost no steps); a step of
  233.0 ms against 60.2 ms of compute + none's all-reduce 278.8 ms / 1.93 (the casts).
- powersgd, ranks 16, 8 from 1/4 and 4 from 7/12 of the steps after a fp16 start of 1/5,
  embeddings too: factor 7/6, overhead 1.18, any optimizer. time_to_quality.json, 100mbit_w2,
  powersgd(4)+fp16start120+16-8-4: none's 2.0272 at step 700 (none: 600); 167.0 ms
  against 63.8 + 1,452 / 51.5 ms. (wide_100m_longer.json's 60-step start, ranks 8 then 4:
  step 800, 4/3.)
- onebit_adam, every tensor, exchanged every 2nd step, freeze at 1/10: factor 13/12,
  overhead 0.95, Adam or AdamW. wide_100m_onebit_every2.json: step 650; 136.3 ms against
  58.3 + 1,455 / 64.0 ms.
- dgc_adam(0.01), every tensor, freeze at 1/10: factor 1.0, overhead 1.54, Adam or AdamW.
  wide_100m_dgc_adam.json: step 600; 179.7 ms against 59.3 + 1,455 / 50.0 ms. Within the
  run too: 2.0041 at step 600 of a 600-step run (compression/wide_600.json).
- diloco: DiLoCo (tfpar.sync), 10 local steps of the user's optimizer, plain averaging (outer
  SGD 1.0, no momentum), int4 outer gradients: factor 13/12, overhead 0.08, any optimizer,
  one exchange per 10 steps (its latency paid once a round). diloco/diloco_20mbit_coded_1200.json
  and diloco_20mbit_overlap_1200.json (gpt_tiny, 20 Mbit/s, given 1,200 steps): none's
  1.6858 first at step 650 in both; 143.4 and 134.1 ms against 122.9 and 110.0 of compute
  + 1,014 ms x 0.0129. It runs in tfpar.Trainer only, and not beside ZeRO, a pipeline, a
  split model or parameter_server (left out by name), and it changes more than the wire:
  each replica trains its own copy between rounds, and evaluation reads the shared weights.
  gpt_wide at 100 Mbit/s (diloco/diloco_wide_100mbit_1200.json) reached none's 2.0272 at
  step 650 too. Both with 2 workers: DiLoCo's quality falls as workers grow (Douillard et
  al.), so for more than 2 workers the factor is an optimistic guess.
- dgc(0.01): never reached its optimizer's loss, SGD with momentum. compression/tiny_600_dgc.json
  (2.2488 against none(sgd)'s 2.0666, +8.8%, with the SGD's own momentum, clip and weight
  decay); overhead 0.09 from tiny_600_sgd.json (163.3 ms against 149.1 + 12.4 / 35.9 ms).
The factors and overheads of onebit_adam, dgc_adam and dgc come from runs made before
they took the user's optimizer (SGD with their own betas, no weight decay); their
equal-step losses were rerun with it and moved by under a point where it matters
(benchmarks/results/compression/README.md), the 100 Mbit/s time-to-quality runs were not.

The steps factor: the step at which a candidate first reached none's final loss (runs
given 900 steps, evaluated every 50) over none's 600. The overhead: what its step took
beyond compute + none's all-reduce x its link-byte ratio, as a fraction of the compute
(its own work and its collectives' latency). A factor above 1 means more steps than none
to reach none's loss: such a candidate is picked only when the run has room for them
(`total_steps` >= factor x `quality_steps`; by default `quality_steps=total_steps`, so only
factors <= 1), and the decision line names every factor and its file. On a fast link none
wins: every candidate's overhead costs more than the link time it saves.

At build the chief decides for everyone: replica 0's measurements (or the decision of a
restored checkpoint) reach every replica and worker through an all-reduce of a few floats
to which only replica 0 contributes, so every worker builds the same candidate. The
decision is checkpointed (`choice`, an index into CANDIDATES): restored before build, it
is used as it is (nothing is measured), and the chosen candidate's state restores into it
as it is built. A checkpoint restored after build with another decision is refused at the
first step: restore before building the Trainer.

Build costs a bounded amount whatever the model: the link is timed on at most 4 MB and
1/16 of that (a latency + seconds per byte, scaled to the gradient), the compute on at most
4M weights and 2 GFLOP (scaled to the model's matrices and tokens), every candidate's bytes
are counted by running its build without making its state, and only the chosen one's state
is created (tfpar.compression.auto_probes).

Example:
    >>> trainer = Trainer(model, keras.optimizers.AdamW(1e-3), loss, strategy=strategy,
    ...                   compression=Auto(total_steps=600, tokens=256))
    >>> trainer.aggregator.decision
    "dgc_adam: link 1.455 s per float32 all-reduce (0.002 s of it latency) vs compute 0.062 s ..."
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfpar.compression import accounting
from tfpar.compression import auto_probes as probes
from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import FP16, CompressionError, NoCompression
from tfpar.compression.dgc import DGC
from tfpar.compression.dgc_adam import DGCAdam
from tfpar.compression.onebit_adam import OneBitAdam
from tfpar.compression.policy import DEFAULT_SKIP, Policy
from tfpar.compression.powersgd import PowerSGD
from tfpar.strategy import private_api

BUT_EMBEDDINGS = tuple(p for p in DEFAULT_SKIP if "embed" not in p)  # skip list: embeddings compressed too


def _powersgd(steps: int) -> Compression:
    """powersgd(4)+fp16start120+16-8-4 scaled from 600 steps to `steps`: a fp16 start of a
    fifth, then rank 16, 8 from a quarter and 4 from 7/12 of `steps` after it."""
    eight = max(1, steps // 4)
    four = max(eight + 1, steps * 7 // 12)
    return Compression(PowerSGD(rank_schedule={0: 16, eight: 8, four: 4}),
                       Policy(skip=BUT_EMBEDDINGS, warmup_steps=max(1, steps // 5), warmup_compressor="fp16"))


def _onebit_adam(steps: int) -> Compression:
    """onebit_adam+all+every2 (freeze 60 of 600)."""
    return OneBitAdam(freeze_step=max(1, steps // 10), exchange_every=2, policy=Policy(min_size=0, skip=()))


def _dgc_adam(steps: int) -> Compression:
    """dgc_adam(0.01)+all+freeze60+momentum0."""
    return DGCAdam(ratio=0.01, freeze_step=max(1, steps // 10), policy=Policy(min_size=0, skip=()))


def _diloco():
    """diloco(10)+avg+int4: 10 local steps, plain averaging, int4 outer gradients."""
    from tfpar.sync import DiLoCo  # pylint: disable=import-outside-toplevel

    return DiLoCo(inner_steps=10, outer_optimizer=keras.optimizers.SGD(1.0), compression="int4")


def _dgc(steps: int) -> Compression:
    """dgc(0.01): a density warm-up over 60 of 600 steps, embeddings too."""
    return Compression(DGC(ratio=0.01, warmup_steps=max(4, steps // 10)), Policy(skip=BUT_EMBEDDINGS))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration Auto may become, with what it was measured to cost (module docstring)."""

    name: str
    steps_factor: float       # steps to none's final loss / none's steps
    overhead: float           # seconds a step beyond compute + link x ratio, / compute
    needs: str                # "any", "adam" (Adam or AdamW) or "momentum_sgd"
    source: str               # the file the factor comes from
    make: Callable[[int], Compression]  # quality steps -> a fresh, unbuilt compression
    sync: Callable[[], object] | None = None  # DiLoCo: a fresh tfpar.sync.DiLoCo the Trainer runs
    exchanges_per_step: float = 1.0  # how often a step pays the link's latency


# Append only: a checkpoint holds the index of its decision.
CANDIDATES = (
    Candidate("none", 1.0, 0.0, "any", "the reference", lambda steps: Compression(NoCompression())),
    Candidate("fp16", 1.0, 0.47, "any", "time_to_quality.json", lambda steps: Compression(FP16())),
    Candidate("powersgd", 7 / 6, 1.18, "any", "time_to_quality.json", _powersgd),
    Candidate("onebit_adam", 13 / 12, 0.95, "adam", "wide_100m_onebit_every2.json", _onebit_adam),
    Candidate("dgc_adam", 1.0, 1.54, "adam", "wide_100m_dgc_adam.json", _dgc_adam),
    Candidate("dgc", math.inf, 0.09, "momentum_sgd", "compression/tiny_600_dgc.json", _dgc),
    Candidate("diloco", 13 / 12, 0.08, "any", "diloco/diloco_20mbit_coded_1200.json",
              lambda steps: Compression(NoCompression()), sync=_diloco, exchanges_per_step=1 / 10),
)
BY_NAME = {c.name: c for c in CANDIDATES}
NAMES = tuple(BY_NAME)
NEEDS = {"adam": "Adam or AdamW", "momentum_sgd": "SGD with momentum"}


def optimizer_kind(optimizer) -> str | None:
    """"adam" (Adam or AdamW without amsgrad), "momentum_sgd", or None (any other)."""
    inner = private_api.base_optimizer(optimizer)
    if isinstance(inner, keras.optimizers.Adam) and not inner.amsgrad:
        return "adam"
    if isinstance(inner, keras.optimizers.SGD) and inner.momentum:
        return "momentum_sgd"
    return None


def left_out(name: str, factors: dict, optimizer: str | None, room: float) -> str | None:
    """Why candidate `name` may not be picked (None: it may)."""
    needs = BY_NAME[name].needs
    if needs not in ("any", optimizer):
        return f"needs {NEEDS[needs]}"
    if not math.isfinite(factors[name]):
        return f"never reached none's loss ({BY_NAME[name].source})"
    if factors[name] > room:
        return f"needs {factors[name]:.3g}x the steps, the run has {room:.3g}x"
    return None


def choose(link_s: float, compute_s: float, ratios: dict, factors: dict | None = None,
           optimizer: str | None = None, room: float = 1.0, latency_s: float = 0.0) -> tuple[str, dict]:
    """(best name, predicted seconds to none's final loss per step of none, by name).

    Args:
      link_s, compute_s: seconds of a float32 all-reduce of every gradient, and of one
        step's forward and backward.
      ratios: name -> link bytes / float32's (over the run to quality) for each candidate
        that can run on the model; "none" is always there.
      factors: name -> steps factor (default: each candidate's measured one).
      optimizer: `optimizer_kind` of the user's optimizer.
      room: the run's steps / the steps whose uncompressed loss is the goal.
      latency_s: the part of `link_s` that fewer bytes do not shorten.

    Example:
        >>> choose(0.01, 0.1, {"none": 1.0, "fp16": 0.5}, optimizer="adam")[0]
        'none'
    """
    factors = {c.name: c.steps_factor for c in CANDIDATES} | dict(factors or {})
    per_byte = link_s - latency_s
    predicted = {name: factors[name] * (compute_s * (1 + BY_NAME[name].overhead)
                                        + latency_s * BY_NAME[name].exchanges_per_step + per_byte * ratio)
                 for name, ratio in ratios.items()}
    allowed = [name for name in predicted if left_out(name, factors, optimizer, room) is None]
    return min(allowed, key=lambda n: (predicted[n], n != "none")), predicted


def _ranked(predicted: dict, optimizer: str | None, room: float) -> str:
    """`choose`'s predictions as the decision line says them: the allowed ones, best first,
    each with its steps factor and the file it comes from, then the others and why."""
    factors = {c.name: c.steps_factor for c in CANDIDATES}
    order = sorted(predicted, key=predicted.get)
    said = [f"{n} {predicted[n]:.4g}" + (f" (steps x{factors[n]:.3g}, {BY_NAME[n].source})" if n != "none" else "")
            for n in order if left_out(n, factors, optimizer, room) is None]
    for n in order:
        why = left_out(n, factors, optimizer, room)
        if why is not None:
            would = f" (would be {predicted[n]:.4g})" if math.isfinite(predicted[n]) else ""
            said.append(f"{n} left out: {why}{would}")
    return "; ".join(said)


class Auto(Compression):
    """Measures at build, then is the chosen candidate (see module docstring).

    Args:
      total_steps: the run's steps.
      tokens: one replica's tokens (or image patches) per step: the compute proxy's rows.
      link_s, compute_s: use these seconds instead of timing them.
      quality_steps: the uncompressed run whose final loss is the goal (default
        `total_steps`); a candidate needing factor x quality_steps steps fits the run when
        that is at most `total_steps`. Candidates' starts scale with it.
    """

    def __init__(self, total_steps: int = 600, tokens: int = 1024, link_s: float | None = None,
                 compute_s: float | None = None, quality_steps: int | None = None):
        tf.Module.__init__(self, name="auto")
        self.total_steps, self.tokens = total_steps, tokens
        self.quality_steps = quality_steps or total_steps
        self.link_s, self.compute_s = link_s, compute_s
        self.choice = tf.Variable(-1, dtype=tf.int64, trainable=False, name="choice")  # -1: undecided
        self.chosen: Compression | None = None
        self.chosen_sync = None  # the chosen's tfpar.sync.DiLoCo, which the Trainer then runs
        self.index: int | None = None  # into CANDIDATES, once built
        self.decision = ""
        self.sync_refused: str | None = "DiLoCo runs in tfpar.Trainer only"  # the Trainer may allow it
        object.__setattr__(self, "_optimizer", None)  # the user's, not tracked

    # -- before build: the optimizer ------------------------------------------------------

    def check_optimizer(self, optimizer) -> None:
        """Notes the user's optimizer: it decides which candidates may run, and the chosen
        one takes its hyper-parameters at build."""
        object.__setattr__(self, "_optimizer", optimizer)

    def optimizer_for(self, optimizer):
        """The chosen candidate's: `optimizer`, or the plain SGD that applies its step."""
        return self.chosen.optimizer_for(optimizer)

    def allow_sync(self, refused: str | None) -> None:
        """The Trainer's word on DiLoCo before build: None (it may be picked) or why not."""
        self.sync_refused = refused

    @property
    def _kind(self) -> str | None:
        return optimizer_kind(self._optimizer) if self._optimizer is not None else None

    # -- build: one decision for every worker ---------------------------------------------

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Decides (replica 0's measurements, or the decision of a checkpoint restored before)
        and builds that candidate alone, under the strategy's scope.

        Raises:
          CompressionError: a restored decision that the optimizer cannot run.
        """
        strategy = tf.distribute.get_strategy()
        restored = int(probes.from_replica_0(strategy, lambda replica: [int(self.choice.numpy())])[0])
        if restored >= 0:
            self.index = restored
            self._check_restored()
            self.decision = (f"{CANDIDATES[restored].name}: restored from the checkpoint (the decision "
                             "of the run that wrote it; nothing measured)")
        else:
            self.index = self._decide(strategy, variables)
            self.choice.assign(self.index)
        candidate = CANDIDATES[self.index]
        if candidate.sync is not None and restored >= 0 and self.sync_refused:
            raise CompressionError(f"This checkpoint's compression='auto' decision is {candidate.name}, "
                                   f"which this run cannot take ({self.sync_refused}): resume as the run "
                                   "that wrote it, or from a fresh workdir.")
        self.chosen_sync = candidate.sync() if candidate.sync is not None else None
        if self.chosen_sync is not None:
            self.decision += (f"; the Trainer runs {self.chosen_sync!r} with plain averaging (outer SGD 1.0): "
                              "each replica trains its own copy between rounds, evaluation reads the shared weights")
        chosen = candidate.make(self.quality_steps)
        if self._optimizer is not None:
            chosen.check_optimizer(self._optimizer)  # adopts Adam's betas, SGD's momentum, ...
        chosen.build(variables)
        self.chosen = chosen  # a checkpoint restored before build lands in its state now
        print(f"compression=auto picked {self.decision}", flush=True)  # one line, whatever the log level

    def _decide(self, strategy, variables) -> int:
        """The index of the candidate replica 0's measurements pick; says why in `decision`."""
        kind = self._kind
        ratios, unusable = self._ratios(variables, kind, strategy.num_replicas_in_sync)
        by_replica = self._measurements(strategy, variables)
        link_s, compute_s, latency_s = probes.from_replica_0(strategy, lambda replica: list(by_replica(replica)))
        room = self.total_steps / self.quality_steps
        name, predicted = choose(link_s, compute_s, ratios, optimizer=kind, room=room, latency_s=latency_s)
        self.decision = (f"{name}: link {link_s:.4g} s per float32 all-reduce ({latency_s:.4g} s of it latency) "
                         f"vs compute {compute_s:.4g} s per step, replica 0's; predicted seconds to none's "
                         f"final loss per step of none: {_ranked(predicted, kind, room)}"
                         + "".join(f"; {why}" for why in unusable))
        return NAMES.index(name)

    def _ratios(self, variables, kind: str | None, replicas: int) -> tuple[dict, list[str]]:
        """(name -> link bytes over its run to quality / float32's, why the others cannot run)."""
        ratios, unusable = {}, []
        for candidate in CANDIDATES:
            if candidate.sync is not None:
                if self.sync_refused:
                    unusable.append(f"{candidate.name} left out: {self.sync_refused}")
                    continue
                fp32 = 4 * sum(int(v.shape.num_elements()) for v in variables)
                fp32_link = accounting.analytic_link_bytes({"reduce": fp32}, max(replicas, 2))
                ratios[candidate.name] = candidate.sync().link_bytes_per_step(variables, max(replicas, 2)) / fp32_link
                continue
            if candidate.needs not in ("any", kind):
                unusable.append(f"{candidate.name} left out: needs {NEEDS[candidate.needs]}")
                continue
            compression = candidate.make(self.quality_steps)
            try:
                if self._optimizer is not None:
                    compression.check_optimizer(self._optimizer)
            except CompressionError as error:  # e.g. Adam with clipnorm: 1-bit Adam clips globally
                unusable.append(f"{candidate.name} left out: {error}")
                continue
            try:
                probes.planned(compression, variables)
            except CompressionError as error:  # e.g. powersgd's rank 16 on a thin matrix
                unusable.append(f"{candidate.name} cannot run on this model: {error}")
                continue
            factor = candidate.steps_factor if math.isfinite(candidate.steps_factor) else 1.0
            steps = math.ceil(factor * self.quality_steps)
            ratios[candidate.name] = probes.run_ratio(compression, variables, steps, replicas)
        return ratios, unusable

    def _measurements(self, strategy, variables) -> Callable[[int], tuple[float, float, float]]:
        """(link s, compute s, latency s) by replica id: this worker's, the same for each of its
        replicas (seconds given to Auto are used as given). Tests replace it to make replicas
        disagree."""
        size = sum(int(v.shape.num_elements()) for v in variables)
        link_s, latency_s = (self.link_s, 0.0) if self.link_s is not None else (
            probes.link_seconds(strategy, size) if probes.communicates(strategy) else (0.0, 0.0))
        compute_s = self.compute_s if self.compute_s is not None else probes.compute_seconds(variables, self.tokens)
        return lambda replica: (link_s, compute_s, latency_s)

    def _check_restored(self) -> None:
        """A restored decision must run with this optimizer."""
        candidate = CANDIDATES[self.index]
        if candidate.needs not in ("any", self._kind):
            raise CompressionError(
                f"This checkpoint's compression='auto' decision is {candidate.name}, which needs "
                f"{NEEDS[candidate.needs]}: resume with the optimizer that wrote it, or from a fresh workdir.")

    # -- after build: the chosen candidate -----------------------------------------------

    def __call__(self, gradients, variables):
        return self.chosen(gradients, variables)

    def boundaries(self):
        return self.chosen.boundaries()

    def phase(self, step):
        """The chosen's phase; refuses a checkpoint restored after build with another decision."""
        restored = int(self.choice.numpy())
        if restored != self.index:
            raise CompressionError(
                f"A checkpoint restored after compression='auto' was built holds another decision "
                f"({CANDIDATES[restored].name}; this run built {CANDIDATES[self.index].name}): restore "
                "the checkpoint before building the Trainer, so that its decision is used.")
        return self.chosen.phase(step)

    def set_phase(self, phase):
        self.chosen.set_phase(phase)

    def state_variables(self):
        return self.chosen.state_variables()

    def payload_bytes(self, variables, phase="compressed"):
        return self.chosen.payload_bytes(variables, phase)

    def describe(self, variables):
        return self.chosen.describe(variables)

    # -- checkpoints: the decision, and the chosen's state -------------------------------

    def checkpoint_items(self) -> dict:
        return {"compression": self}

    def _checkpoint_children(self) -> dict:
        state = self.chosen.checkpoint_items() if self.chosen is not None else {}
        return {"choice": self.choice, **{"chosen": item for item in state.values()}}

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint":
            return tf.Module._trackable_children(self, save_type, **kwargs)
        return self._checkpoint_children()

    def _lookup_dependency(self, name, cached_dependencies=None):
        # tf.Module's (a restore looks in _trackable_children: "chosen" is None before build,
        # and its restore waits for it), not Compression's reading of older checkpoints
        return tf.Module._lookup_dependency(self, name, cached_dependencies)

    def __repr__(self):
        return f"auto({NAMES[self.index]})" if self.index is not None else "auto"
