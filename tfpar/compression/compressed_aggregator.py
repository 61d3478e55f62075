"""Compressed gradient aggregation: the Trainer's aggregation seam with a compressor in it.

Called once per step in the replica context with this replica's gradients; returns the
gradients summed over all replicas, having sent each through its compressor (chosen per
tensor by the policy). Collectives are fused: one all-reduce for every float32 tensor,
one per cheaper dtype, one all-gather for every packed payload, and two all-reduces for
all PowerSGD matrices. Nothing is reduced twice: the Trainer keeps Keras from its own
all-reduce, so these are the only collectives on the gradients.

DGC (tfpar.compression.dgc) takes the whole step (momentum correction touches every
tensor). DGC's density warm-up and PowerSGD's rank schedule are stages after the
policy's uncompressed start: each stage is a phase, traced once, with static sizes.

Error-feedback residuals, DGC's velocities and PowerSGD's warm-start Q are variables with
one copy per replica (ON_READ). They are checkpointed with the model replica by replica
(tfpar.compression.replica_state): a restore under the same replica count gives each
replica its own copy back exactly; under another count the sum still owed is split evenly
and Q (the same everywhere) restores exactly. Checkpoints that hold one mean per variable
(written before) restore that mean into every replica; `reset_on_restore=True` leaves the
state out instead.

Example:
    >>> trainer = Trainer(model, optimizer, loss, strategy=strategy,
    ...                   compression=Compression(TopK(0.01), Policy(warmup_steps=50)))
"""

from __future__ import annotations

import re
from typing import Sequence

import tensorflow as tf

from absl import logging

from tfpar.compression import clipping
from tfpar.compression import dgc as dgc_lib
from tfpar.compression import replica_state
from tfpar.compression.compressors import (CompressionError, Compressor, GatherCompressor,
                                           ReduceCompressor)
from tfpar.compression.dgc import DGC
from tfpar.compression.policy import Policy
from tfpar.compression.powersgd import PowerSGD
from tfpar.compression.replica_state import per_replica
from tfpar.aggregation import GradientAggregator, communicates, densify_if_smaller
from tfpar.strategy import private_api

PER_REPLICA = "per_replica"  # the checkpoint child holding every replica's state
SIZE_EXCHANGE_BYTES = 8  # every all_gather first gathers its input's shape: 2 x int32 here


def _state_name(index: int, path: str) -> str:
    return f"{index:03d}_" + re.sub(r"[^A-Za-z0-9_.]", "_", path)


class Compression(tf.Module, GradientAggregator):
    """The compressing GradientAggregator: sends gradients through `compressor` under
    `policy` (see module docstring)."""

    def __init__(self, compressor: Compressor, policy: Policy | None = None,
                 reset_on_restore: bool = False):
        super().__init__(name="compression")
        if not isinstance(compressor, Compressor):
            raise CompressionError(f"Expected a tfpar.compression compressor, got {compressor!r}.")
        self.compressor, self.policy = compressor, policy or Policy()
        self.reset_on_restore = reset_on_restore
        self.plan: list[Compressor | None] = []
        self.paths: list[str] = []
        self.state: dict = {}
        self._phase = None

    # -- set-up (cross-replica context, under strategy.scope()) -------------------------

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Chooses a compressor per variable and creates the per-replica state (a checkpoint
        restored before this lands in it now)."""
        self._build_state(variables)
        self._replica_state().refresh()

    def _build_state(self, variables: Sequence[tf.Variable]) -> None:
        self.paths = [getattr(v, "path", v.name) for v in variables]
        wanted = [self.policy.wanted(path, tuple(v.shape), self.compressor)
                  for path, v in zip(self.paths, variables)]
        for path, v, asked in zip(self.paths, variables, wanted):
            if isinstance(asked, PowerSGD):
                asked.check_shape(path, tuple(v.shape))
        self.plan = [self.policy.choose(path, tuple(v.shape), self.compressor)
                     for path, v in zip(self.paths, variables)]
        # matrices PowerSGD was asked for and the policy left dense: its rank would send more
        dense = [(asked, path, asked.matrix_shape(tuple(v.shape)))
                 for path, v, asked, chosen in zip(self.paths, variables, wanted, self.plan)
                 if isinstance(asked, PowerSGD) and chosen is None and len(v.shape) >= 2]
        _say_dense_matrices(dense, compressed=any(isinstance(c, PowerSGD) for c in self.plan),
                            main=isinstance(self.compressor, PowerSGD))
        sent = (*self.plan, self.policy.start())  # the start and every compressor chosen (overrides too)
        for compressor in {repr(c): c for c in sent if c is not None}.values():
            _check_dtype_support(compressor, tf.distribute.get_strategy())
        self._check_plan()
        for index, (path, variable, chosen) in enumerate(zip(self.paths, variables, self.plan)):
            slots = {}
            if isinstance(self.compressor, DGC):  # momentum for every tensor
                # local where the tensor is compressed, agreed (the same everywhere) where not
                slots["velocity"] = per_replica(tf.zeros(variable.shape, tf.float32), "velocity",
                                                replica_state.SUM if chosen is not None else replica_state.SAME)
            if chosen is not None and chosen.error_feedback:
                slots["residual"] = per_replica(tf.zeros(variable.shape, tf.float32), "residual", replica_state.SUM)
            if isinstance(chosen, PowerSGD):
                slots["q"] = per_replica(chosen.initial_q(variable.shape, index), "q", replica_state.SAME)
            if slots:
                self.state[_state_name(index, path)] = slots

    def _check_plan(self) -> None:
        chosen = {type(c) for c in self.plan if c is not None}
        if isinstance(self.compressor, DGC) and chosen - {DGC}:
            raise CompressionError("dgc compresses with momentum correction and cannot share a step "
                                   "with other compressors: overrides may only say 'dgc' or 'none'.")
        if DGC in chosen and not isinstance(self.compressor, DGC):
            raise CompressionError("dgc must be the main compressor (Compression(DGC(...))), not an "
                                   "override: its momentum covers every tensor.")
        if isinstance(self.compressor, DGC) and self.policy.start() is not None:
            raise CompressionError(
                f"dgc's start is momentum SGD at density 1 in float32; warmup_compressor="
                f"{self.policy.start()!r} applies to the other compressors. Leave it 'none' for dgc.")
        staged = {repr(c) for c in self.plan if isinstance(c, (PowerSGD, DGC))}
        if len(staged) > 1:
            raise CompressionError(f"One schedule per run: the policy picked {sorted(staged)}; give "
                                   "overrides the same powersgd/dgc as the main compressor.")

    def check_optimizer(self, optimizer) -> None:
        """Refuses a Keras optimizer that cannot apply what this compressor returns, and
        reads what the compressor takes of it (DGC: SGD's momentum and clipping)."""
        check = getattr(self.compressor, "check_optimizer", None)
        if check is not None:
            check(optimizer)
        lossy = self._lossy()
        if lossy and private_api.base_optimizer(optimizer).gradient_accumulation_steps:
            raise CompressionError(
                f"{lossy} with the optimizer's gradient_accumulation_steps would compress every "
                "micro-batch on its own (each with its own error feedback and bytes), not their "
                "sum: accumulate before the compressor with tfpar.Trainer(accumulate=K) "
                "(--config.train.accumulate=K), or in Keras fit give a K times larger batch.")

    def _lossy(self) -> str | None:
        """The name of a compressor here that is not a plain sum in some dtype (None if none)."""
        from tfpar.compression import get  # pylint: disable=import-outside-toplevel  (names -> compressors)

        chosen = [self.compressor, *(get(c) if isinstance(c, str) else c for c in self.policy.overrides.values())]
        lossy = [c for c in chosen if not isinstance(c, ReduceCompressor)]
        return repr(lossy[0]) if lossy else None

    def optimizer_for(self, optimizer):
        """What applies the result: `optimizer`, or (DGC) a plain SGD with its learning rate."""
        chosen = getattr(self.compressor, "optimizer_for", None)
        return optimizer if chosen is None else chosen(optimizer)

    def state_variables(self) -> tuple[tf.Variable, ...]:
        """Everything this aggregator keeps per replica (residuals, Q, velocities, moments)."""
        return tuple(self.variables)

    def checkpoint_items(self) -> dict:
        """What the Trainer adds to its checkpoint (nothing with reset_on_restore)."""
        return {} if self.reset_on_restore or not self.state else {"compression": self}

    # -- checkpoints: every replica's state (tfpar.compression.replica_state) ------------

    def _replica_state(self) -> replica_state.ReplicaState:
        state = self.__dict__.get("_per_replica_child")
        if state is None:  # not an attribute tf.Module tracks
            state = replica_state.ReplicaState(self)
            object.__setattr__(self, "_per_replica_child", state)
        return state

    def legacy_children(self) -> dict:
        """What tf.Module tracks: the state by attribute path (older checkpoints hold these)."""
        return super()._trackable_children(save_type="checkpoint")

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        return {PER_REPLICA: self._replica_state()}

    def _lookup_dependency(self, name, cached_dependencies=None):
        """In a restore (`cached_dependencies` given): the per-replica state, or a checkpoint
        written before it, read by its old rule: each replica gets the mean (said once)."""
        if cached_dependencies is None or name == PER_REPLICA:
            return super()._lookup_dependency(name, cached_dependencies)
        if not self.__dict__.get("_said_mean_rule"):
            object.__setattr__(self, "_said_mean_rule", True)
            logging.warning("tfpar: this checkpoint holds compression state as one mean over replicas "
                            "(written before per-replica state): every replica restores that mean.")
        return self.legacy_children().get(name)

    # -- warm-up: the Trainer traces one step per phase ----------------------------------

    def _stages(self) -> list[tuple[int, object]]:
        """(first step after the uncompressed start, parameter) of each compressed stage."""
        staged = getattr(self.compressor, "stages_at", None)
        return staged() if staged is not None else [(0, None)]

    def boundaries(self) -> tuple[int, ...]:
        start = self.policy.warmup_steps
        cuts = {start + s for s, _ in self._stages()} - {0}
        return tuple(sorted(cuts))

    def phase(self, step: int):
        """'warmup', 'compressed', or ('compressed', density or rank) for a staged compressor."""
        if step < self.policy.warmup_steps:
            return "warmup"
        stages = self._stages()
        param = [p for s, p in stages if s <= step - self.policy.warmup_steps][-1]
        return "compressed" if len(stages) == 1 else ("compressed", param)

    def set_phase(self, phase) -> None:
        self._phase = phase

    def _plan_for(self, phase, gradients=None, variables=None) -> list:
        """The compressor per variable in `phase`: the start sends every tensor through the
        policy's warm-up compressor (None: float32), later phases follow the plan. Given the
        step's gradients, a sparse one that would go sparse (densify_if_smaller) stays sparse
        in float32 in the start, as without a warm-up compressor."""
        if phase != "warmup":
            return self.plan
        start = self.policy.start()
        if gradients is None:
            return [start] * len(self.plan)
        return [None if isinstance(densify_if_smaller(g, v), tf.IndexedSlices) else start
                for g, v in zip(gradients, variables)]

    def _param(self, phase=None):
        """The stage parameter (DGC density, PowerSGD rank) of `phase` (default: traced one)."""
        phase = self._phase if phase is None else phase
        if isinstance(phase, tuple):
            return phase[1]
        return None if phase == "warmup" else self._stages()[-1][1]

    # -- the step (replica context) ------------------------------------------------------

    def __call__(self, gradients: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> list:
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        communicate = communicates(context)
        plan = self._plan_for(self._phase, gradients, variables)
        result: list = [None] * len(gradients)

        def all_reduce(tensors: list) -> list:
            if not tensors or not communicate:
                return list(tensors)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))

        if isinstance(self.compressor, DGC):
            return self._dgc_step(gradients, variables, replicas, all_reduce,
                                  lambda w: _all_gather_words(context, w) if communicate else w)

        # float32 and cheaper-dtype tensors: one fused all-reduce per wire dtype.
        by_dtype: dict = {}
        for i, (g, chosen) in enumerate(zip(gradients, plan)):
            if chosen is None or isinstance(chosen, ReduceCompressor):
                by_dtype.setdefault(chosen.wire_dtype if chosen else tf.float32, []).append(i)
        for indices in by_dtype.values():
            sent = [plan[i].encode(_dense(gradients[i], variables[i]), replicas) if plan[i]
                    else densify_if_smaller(gradients[i], variables[i]) for i in indices]
            for i, summed in zip(indices, all_reduce(sent)):
                result[i] = plan[i].decode(summed, replicas) if plan[i] else summed

        # packed payloads: one all-gather of every replica's concatenated words.
        gathered = [i for i, c in enumerate(plan) if isinstance(c, GatherCompressor)]
        if gathered:
            words = [self._encode_with_feedback(i, plan[i], _dense(gradients[i], variables[i]))
                     for i in gathered]
            sizes = [int(w.shape[0]) for w in words]
            everyone = tf.concat(words, 0)[None]
            if communicate:
                everyone = _all_gather_words(context, everyone)  # [R, total words]
            for i, part, size in zip(gathered, tf.split(everyone, sizes, axis=1), sizes):
                flat = plan[i].decode_sum(part, int(variables[i].shape.num_elements()))
                result[i] = tf.reshape(flat, variables[i].shape)

        # PowerSGD: two fused all-reduces for every matrix.
        low_rank = [i for i, c in enumerate(plan) if isinstance(c, PowerSGD)]
        if low_rank:
            psgd: PowerSGD = plan[low_rank[0]]
            matrices, residuals, qs = [], [], []
            for i in low_rank:
                slots = self.state[_state_name(i, self.paths[i])]
                n, m = psgd.matrix_shape(variables[i].shape)
                matrices.append(tf.reshape(_dense(gradients[i], variables[i]), [n, m])
                                + tf.reshape(slots["residual"], [n, m]))
                residuals.append(slots["residual"])
                qs.append(slots["q"])
            approx = psgd.aggregate(matrices, qs, all_reduce, self._param())
            for i, matrix, residual, total in zip(low_rank, matrices, residuals, approx):
                residual.assign(tf.reshape(matrix - total / replicas, residual.shape))
                result[i] = tf.reshape(total, variables[i].shape)
        return result

    def _dgc_step(self, gradients, variables, replicas, all_reduce, all_gather) -> list:
        slots = [self.state[_state_name(i, p)] for i, p in enumerate(self.paths)]
        density = 1.0 if self._phase == "warmup" else self._param()
        return dgc_lib.aggregate(self.compressor, slots, [_dense(g, v) for g, v in zip(gradients, variables)],
                                 [c is not None for c in self.plan], density, replicas,
                                 all_reduce, all_gather)

    def _encode_with_feedback(self, index: int, compressor: GatherCompressor, gradient) -> tf.Tensor:
        flat = tf.reshape(gradient, [-1])
        if not compressor.error_feedback:
            return compressor.encode(flat)
        residual = self.state[_state_name(index, self.paths[index])]["residual"]
        accumulated = flat + tf.reshape(residual, [-1])
        words = compressor.encode(accumulated)
        sent = compressor.decode_sum(words[None], int(flat.shape[0]))
        residual.assign(tf.reshape(accumulated - sent, residual.shape))
        return words

    # -- byte accounting -----------------------------------------------------------------

    def payload_bytes(self, variables: Sequence[tf.Variable], phase="compressed") -> dict:
        """Analytic bytes per replica per step, per variable path, plus '(size exchange)'.
        `phase`: one of `phase(step)`'s values ('compressed': the last stage)."""
        plan = self._plan_for(phase)
        param = self._param(phase)
        report, gathers = {}, False
        for path, variable, chosen in zip(self.paths, variables, plan):
            size = int(variable.shape.num_elements())
            if isinstance(chosen, (DGC, PowerSGD)):
                report[path] = chosen.payload_bytes(size, variable.shape, param)
            else:
                report[path] = chosen.payload_bytes(size, variable.shape) if chosen else 4 * size
            gathers |= isinstance(chosen, GatherCompressor) or (
                isinstance(chosen, DGC) and param < 1)
        if gathers:
            report["(size exchange)"] = SIZE_EXCHANGE_BYTES
        if isinstance(self.compressor, DGC) and self.compressor.clip_norm and param is not None and param < 1:
            report["(clip norm)"] = clipping.NORM_BYTES  # the agreed norm, on the dense all-reduce
        return report

    def describe(self, variables: Sequence[tf.Variable]) -> list[tuple[str, str, int, int]]:
        """(path, compressor, fp32 bytes, bytes sent) per variable: the plan as a table."""
        sent = self.payload_bytes(variables)
        return [(path, repr(c) if c else "none", 4 * int(v.shape.num_elements()), sent[path])
                for path, v, c in zip(self.paths, variables, self.plan)]


def _all_gather_words(context, words: tf.Tensor) -> tf.Tensor:
    """All-gathers int32 words bit for bit: as int32 where the strategy gathers by a masked
    sum (TPU), as float32 bits on CollectiveGatherV2 elsewhere (see compression/gather.py)."""
    from tfpar.compression import gather  # pylint: disable=import-outside-toplevel

    return gather.all_gather_words(context, words)


def _say_dense_matrices(dense: list, compressed: bool, main: bool) -> None:
    """Refuses a PowerSGD rank that compresses no matrix at all; names the matrices it
    leaves in float32 otherwise (there rank x (n + m) >= n x m: it would send more).
    `main`: PowerSGD is the Compression's own compressor (else only an override)."""
    if not dense:
        return
    chosen = dense[0][0]
    listed = ", ".join(f"{path} ({n}x{m})" for _, path, (n, m) in dense[:4]) + (
        f" and {len(dense) - 4} more" if len(dense) > 4 else "")
    if not compressed:
        most = max((n * m - 1) // (n + m) for _, _, (n, m) in dense)
        largest = " (the largest of its schedule)" if len(chosen.schedule) > 1 else ""
        fix = (f"use a rank{largest} of at most {most}" if most >= 1
               else "these matrices are too thin for PowerSGD at any rank: leave them out (Policy(skip=...), compression_args.skip)")
        raise CompressionError(
            f"{chosen!r} would send no fewer floats than float32 for any matrix it was asked to "
            f"compress (rank x (n + m) >= n x m for {listed}): {fix}, or "
            + ("compression='none'." if main else "drop the powersgd override."))
    logging.warning("tfpar: %r leaves %d matri%s in float32, where rank %d would send no fewer "
                    "floats: %s.", chosen, len(dense), "x" if len(dense) == 1 else "ces",
                    chosen.max_rank, listed)


def _dense(gradient, variable) -> tf.Tensor:
    """float32, dense, with the variable's static shape (a sparse gradient has none)."""
    return tf.ensure_shape(tf.cast(tf.convert_to_tensor(gradient), tf.float32), variable.shape)


def _check_dtype_support(compressor: Compressor, strategy: tf.distribute.Strategy) -> None:
    if getattr(compressor, "wire_dtype", None) != tf.bfloat16:
        return
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy: one device, no all-reduce to refuse
        return
    if any("GPU" in d.upper() for d in devices):
        sent, fix = compressor.bfloat16_on_gpus
        raise CompressionError(f"{sent} cannot be summed by NCCL, the all-reduce used on GPUs. Use {fix}.")
