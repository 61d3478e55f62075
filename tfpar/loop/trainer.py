"""tfpar.Trainer: the custom training loop, same numbers as Keras fit, one all-reduce per step.

Per step, on every replica: forward and backward on the local batch (loss averaged over
the global batch, as Keras does), gradient accumulation over `accumulate` micro-batches,
then the aggregator (one all-reduce) on gradients in their true units (fp16's loss scale
divided out first and put back after, exactly: it is a power of two), a sparse gradient's
repeated rows summed per index (so Adam sees the dense math), and the optimizer, whose own
all-reduce is off while the step is traced (and only then:
tfpar.strategy.private_api.trainer_step): its clipping (`global_clipnorm`, `clipnorm`,
`clipvalue`), weight decay, gradient accumulation and EMA then act on the summed
gradients, identical on every replica, so equal to one device's
(tfpar.strategy.optimizer_update). `steps_per_loop` steps run inside one tf.function call.

Under `parameter_server` the same step runs asynchronously: the chief schedules it onto
the workers with a ClusterCoordinator (see tfpar.loop.parameter_server); each worker
applies its own gradients to the variables on the parameter servers.

Example:
    >>> trainer = Trainer(model, optimizer, loss, strategy=strategy, steps_per_loop=10)
    >>> trainer.fit(distributed_dataset, steps=600, callbacks=[...])
    >>> trainer.evaluate(validation, steps=10)     # {'loss': ..., 'accuracy': ..., ...}
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import keras
import tensorflow as tf
from absl import logging

from tfpar import evaluation, tensor_parallel, zero
from tfpar.aggregation import GradientAggregator
from tfpar.compression import accounting
from tfpar.compression.auto import Auto
from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import Compressor
from tfpar.errors import ShardingError
from tfpar.loop import parameter_server
from tfpar.loop.forward_backward import ForwardBackward
from tfpar.loop.nonfinite import POLICIES as NONFINITE_POLICIES
from tfpar.loop.nonfinite import NonFiniteGuard
from tfpar.loop.options import (TrainerError, aggregator_for, check_placement, skipped_step_state,  # noqa: F401
                                tensor_parallel_layout, unpack)
from tfpar.profiling import stragglers
from tfpar.strategy import keras_fixes, optimizer_update, private_api


def _scaled(gradient, factor):
    """`gradient` times a scalar, dense or sparse (None stays None)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


def _evaluation_hooks(layout, gathers: bool) -> tuple:
    """(batch check, batch preparation) of tfpar.evaluation for a tensor-parallel model
    (made once: evaluation keeps one traced step per pair)."""
    if layout is None:
        return None, None
    if gathers:
        return None, lambda batch: tensor_parallel.gather_group_batch(batch, layout)
    return (lambda batch: tensor_parallel.batch_differs(batch, layout)), None


class _RunningMean:
    def __init__(self):
        self.count, self.value = 0, 0.0

    def add(self, value: float, count: int) -> float:
        self.value = (self.value * self.count + value * count) / (self.count + count)
        self.count += count
        return self.value


def _sync_conflicts(trainer) -> list[str]:
    """What the Trainer runs that DiLoCo does not compose with (yet), by name."""
    others = {"parameter_server": trainer._async is not None, "shard": trainer._sharded is not None,
              "placement (a pipeline)": trainer.placement is not None,
              "a tensor-parallel model": trainer._tensor_layout is not None}
    return [name for name, present in others.items() if present]


def _check_sync(sync, trainer) -> None:
    """Refuses, by name, what DiLoCo does not compose with (yet)."""
    from tfpar.sync import SyncError  # pylint: disable=import-outside-toplevel

    found = _sync_conflicts(trainer) + (["compression or an aggregator"]
                                        if type(trainer.aggregator).__name__ != "AllReduce" else [])
    if found:
        raise SyncError(f"{sync!r} with {', '.join(found)}: DiLoCo's replicas train their own copies "
                        "and exchange weights every inner_steps steps; combining it with that is not "
                        "built. Use one of them.")


def _check_optimizer_strategy(optimizer, strategy: tf.distribute.Strategy) -> None:
    """Refuses an optimizer made under another strategy than the Trainer's (Keras's own
    error comes from deep inside `build`: "Mixing different tf.distribute.Strategy")."""
    made_under = private_api.strategy_of_optimizer(optimizer)
    if made_under is not None and made_under is not strategy:
        raise TrainerError(
            f"The optimizer was made under another strategy ({type(made_under).__name__}) than the "
            f"Trainer's ({type(strategy).__name__}): make it inside `with strategy.scope():`, "
            "where the model was built.")


class Trainer:
    """Trains a built Keras model under a tf.distribute strategy with tfpar's own loop.

    Args:
      model, optimizer, loss: Keras objects; `loss` is a keras.losses.Loss (its unreduced
        `call` gives per-example values). Build the model under `strategy.scope()`.
      strategy: the tf.distribute strategy (default: the current one).
      steps_per_loop: steps per tf.function call (callbacks fire after each call).
      accumulate: micro-batches per optimizer step; each batch of the dataset is one
        micro-batch, so one step consumes `accumulate` batches.
      aggregator: the gradient-aggregation seam (default: one batched all-reduce).
      compression: a tfpar.compression compressor (e.g. TopK(0.01)) or a Compression
        (compressor + policy); shorthand for the aggregator that compresses.
      placement: a tfpar.placement.Pipeline: the model's stage groups run on their
        devices, micro-batch by micro-batch (XLA is then off: the pipeline spans devices).
        With a hybrid plan (`plan.replicate`) each replica runs its own pipeline under
        `plan.strategy` and the aggregator (compression too) syncs their gradients.
      nonfinite: what a step whose summed gradients hold NaN or Inf does: "stop" (default:
        `fit` raises NonFiniteError naming the step, after the call that met it, before any
        callback could checkpoint it), "skip" (that step's update is not applied, as Keras's
        LossScaleOptimizer skips; counted in `skipped_steps`; a compression's state, such as
        its error feedback, stays as it was before that step) or "ignore". Under fp16 the
        LossScaleOptimizer already skips such steps (that is how it finds its scale), and
        the compression's state is kept the same way. With a stateful compression, stop
        and skip see NaN in any one replica's own gradients even where the compressed sum
        is finite (a held 1-bit Adam step, an unsent top-k entry): one scalar all-reduce
        a step, as DeepSpeed's overflow check.
      shard: "none", "optimizer" (ZeRO-1) or "gradients" (ZeRO-2), or a
        tfpar.zero.update.ZeroUpdate: each replica keeps and updates 1/R of the
        optimizer state (with "gradients" also 1/R of the accumulated gradients), the same
        update as Keras's optimizer (see tfpar.zero.update). Its optimizer state is
        checkpointed as `checkpoint_items()["optimizer"]`, in Keras's layout; the optimizer
        object passed in saves, restores and loads the same state (tfpar.zero.own_optimizer).
        None (default): "none", except for a model built under a keras.distribution whose
        layout map lays weights on the batch axis over several replicas: "gradients"
        (tfpar.distribution.Plan.shard_for); a line at start says which.
      sync: a tfpar.sync.DiLoCo: each replica takes `inner_steps` steps of `optimizer` on
        its own batches with no all-reduce, then the replicas average their deltas and an
        outer optimizer updates the shared weights (see tfpar.sync.diloco). Its anchor and
        outer optimizer are in `checkpoint_items()`.
      xla: jit-compile forward + backward (default on). The compiled function is pure:
        it takes the variables' values as tensors (Keras `stateless_call`), which is what
        lets XLA run under MirroredStrategy too (a compiled function that captures mirrored
        variables reads them from the wrong device). The update is never compiled.
      step_timer: time each replica's own part of every step, from before it reads its
        batch to its gradients being ready (before any wait on other workers), for
        `own_step_seconds` (tfpar.profiling.stragglers; two timestamps a step; not under
        parameter_server or shard).
    """

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 loss: keras.losses.Loss, strategy: tf.distribute.Strategy | None = None, *,
                 steps_per_loop: int = 1, accumulate: int = 1,
                 aggregator: GradientAggregator | None = None,
                 compression: Compressor | Compression | None = None, placement=None,
                 nonfinite: str = "stop", xla: bool | None = None, sum_sparse_rows: bool = True,
                 shard: str | zero.ZeroUpdate | None = None, sync=None, step_timer: bool = False):
        self.model, self.optimizer, self.loss = model, optimizer, loss
        # the strategy given, else the one the model was built under (its scope, or a
        # keras.distribution that tfpar runs), else the one in scope
        self.strategy = strategy or getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
        if steps_per_loop < 1 or accumulate < 1:
            raise TrainerError("steps_per_loop and accumulate must be >= 1.")
        self.steps_per_loop, self.accumulate = steps_per_loop, accumulate
        if nonfinite not in NONFINITE_POLICIES:
            raise TrainerError(f"nonfinite={nonfinite!r}: choose one of {', '.join(NONFINITE_POLICIES)}.")
        self._loss_scaled = loss_scaled = private_api.is_loss_scaled(optimizer)
        skips = nonfinite == "skip" or loss_scaled
        if loss_scaled:  # fp16: the loss scale skips by itself
            nonfinite = "ignore"
        keras_fixes.apply_and_report()  # accumulation and EMA under mirrored need fix 4
        self._choose_parallelism(aggregator, compression, placement, shard, sync, nonfinite)
        # XLA is off with a pipeline (the step spans devices) and with tensor parallelism
        # (the layers' collectives run inside forward and backward)
        self.xla = ((True if xla is None else bool(xla)) and placement is None
                    and self._tensor_layout is None)
        self.sum_sparse_rows = sum_sparse_rows
        self._build_state(nonfinite)
        self._timer = stragglers.StepTimer(self.strategy) if step_timer and not (
            self._async or self._sharded) else None
        self._build_sync()
        self._build_steps(accumulate, placement, skips, nonfinite)

    def _choose_parallelism(self, aggregator, compression, placement, shard, sync, nonfinite: str) -> None:
        """The aggregator, ZeRO, placement, parameter-server and DiLoCo settings, each checked
        by name against the others before anything is built."""
        model, optimizer = self.model, self.optimizer
        self.aggregator = aggregator_for(self.strategy, aggregator, compression, model)
        self._tensor_layout = tensor_parallel_layout(model)  # None: the model is not split
        self._shard_by_default = shard is None and sync is None  # the layout map may give ZeRO-2
        self._sharded = self._zero_update(model, shard, sync, optimizer, placement, nonfinite)
        self.aggregator.check_optimizer(optimizer)
        self.placement = placement
        if placement is not None:  # before a coordinator starts: refused early
            check_placement(model, self.strategy, placement)
        is_async = parameter_server.is_parameter_server(self.strategy)
        self._async = parameter_server.AsyncSteps(self.strategy) if is_async else None
        self._sync = sync
        if sync is not None:
            _check_sync(sync, self)
        if isinstance(self.aggregator, Auto):  # auto may pick DiLoCo where nothing here conflicts
            conflicts = _sync_conflicts(self)
            self.aggregator.allow_sync(f"not beside {', '.join(conflicts)}" if conflicts else None)

    def _build_state(self, nonfinite: str) -> None:
        """Under the strategy: the aggregator's state, the optimizer that applies its output
        (or ZeRO's partitions of it), the loss sum and the non-finite guard."""
        model = self.model
        with self.strategy.scope():
            self.aggregator.build(model.trainable_variables)
            if getattr(self.aggregator, "chosen_sync", None) is not None:  # auto picked DiLoCo
                self._sync = self.aggregator.chosen_sync
            # what applies the aggregator's output: the user's optimizer, or (a compressor
            # that computes Adam's or momentum's step itself) an SGD with its learning rate
            self.optimizer = optimizer = self.aggregator.optimizer_for(self.optimizer)
            private_api.check_optimizer(optimizer, sharded_updates=self._async is not None)
            _check_optimizer_strategy(optimizer, self.strategy)
            if self._sharded is None:
                optimizer.build(model.trainable_variables)  # before any traced step
            else:  # each replica's 1/R of the optimizer, in place of the whole one
                with _naming_the_default(self._shard_by_default):
                    self._sharded.build(model.trainable_variables)
            self._loss_sum = None if self._async else tf.Variable(
                0.0, trainable=False, name="loss_sum",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)
            self._guard = None if self._async else NonFiniteGuard(nonfinite)

    def _build_sync(self) -> None:
        """DiLoCo's anchor and outer optimizer, every replica's own copies checkpointed, and
        the weights noted (changes made outside the Trainer are checked when it takes them up)."""
        self._fitting = False
        sync = self._sync
        if sync is None:
            return
        sync.build(self.strategy, self.model.trainable_variables)
        sync.keep_replica_copies([*self.model.trainable_variables,
                                  *(v for v in self.optimizer.variables if v is not self.optimizer.iterations)])
        sync.note_weights()

    def _build_steps(self, accumulate: int, placement, skips: bool, nonfinite: str) -> None:
        """The batch checks of a split model, the forward-backward pass and the loops'
        tf.functions (nothing traced yet)."""
        # a TP group's replicas share one batch: dealt so by tfpar's data (the first step
        # checks it), or, under a keras.distribution (Keras's dealing), gathered every step
        self._gathers_batches = self._tensor_layout is not None and getattr(
            self._tensor_layout.strategy, "_tfpar_plan", None) is not None
        self._batch_check = None if self._tensor_layout is None or self._gathers_batches else \
            tensor_parallel.GroupBatchCheck(self._tensor_layout)
        self._evaluation_hooks = _evaluation_hooks(self._tensor_layout, self._gathers_batches)
        self._skipped_step_state = skipped_step_state(
            () if self._async else self.aggregator.state_variables(), skips, nonfinite)
        self.step = 0  # the next optimizer step; fit sets it from start_step
        self._forward_backward = ForwardBackward(self.model, self.loss, self.strategy, accumulate, placement,
                                                 self.xla)
        self._compute = self._forward_backward.compiled  # the pure, compiled pass
        self._train_loop = tf.function(self._train_loop_fn, reduce_retracing=True)
        self._train_loop_exchanging = tf.function(self._exchanging_loop_fn, reduce_retracing=True)
        # The coordinator binds only tensor arguments: its function has no phase argument.
        self._scheduled_loop = tf.function(lambda iterator, steps: self._train_loop_fn(iterator, steps))

    def _zero_update(self, model, shard, sync, optimizer, placement, nonfinite) -> zero.ZeroUpdate | None:
        """The sharded update for `shard` (None: the model's layout map decides; DiLoCo keeps
        each replica's own optimizer state, so none with it), checked by name before
        anything is built; over each data-parallel group of a split model."""
        sharded = zero.zero_update(_shard_of(model, self.strategy, "none" if shard is None and sync else shard))
        if sharded is None:
            return None
        if self._tensor_layout is not None:
            # ZeRO over each data-parallel group of the split model (tfpar.zero.update): its
            # update sums the gradients; the tensor-parallel aggregator only checks the optimizer
            sharded.split_over(self._tensor_layout)
            self.aggregator.leave_to_partitions()
        with _naming_the_default(self._shard_by_default):
            sharded.configure(self.strategy, optimizer, self.aggregator, placement, nonfinite)
        return sharded

    @property
    def skipped_steps(self) -> int:
        """Steps whose update nonfinite='skip' left out."""
        return self._guard.skipped_steps if self._guard is not None else 0

    # -- one replica ------------------------------------------------------------------

    def _loss_scale(self) -> tf.Tensor:
        """fp16: the dynamic loss scale (1.0 otherwise)."""
        if self._sharded is not None:
            return self._sharded.loss_scale()
        scale = getattr(self.optimizer, "dynamic_scale", None)
        return tf.constant(1.0) if scale is None else tf.cast(scale.value, tf.float32)

    def _aggregate(self, summed, variables):
        """The aggregator's sum; a skipped step leaves the aggregator's state as it was."""
        if self._skipped_step_state is None:
            return self.aggregator(summed, variables)
        saved = self._skipped_step_state.save(summed)
        return self._skipped_step_state.restore_if_skipped(self.aggregator(summed, variables), saved)

    def _replica_step(self, batches: Sequence, index=0, started=None):
        variables = self.model.trainable_variables
        if self._gathers_batches:
            batches = [tensor_parallel.gather_group_batch(batch, self._tensor_layout) for batch in batches]
        if self._batch_check is not None:
            self._batch_check.in_step(batches[0])
        if self._sharded is not None:
            passes = (self._forward_backward(*unpack(batch), self._loss_scale()) for batch in batches)
            total = self._sharded.replica_step(passes, variables, index, self._guard, self._aggregate)
            self._loss_sum.assign_add(total)
            return total
        total, summed = None, None
        for batch in batches:
            loss, grads = self._forward_backward(*unpack(batch), self._loss_scale())
            total = loss if total is None else total + loss
            if self.accumulate > 1:  # sparse (embedding) gradients are summed densely
                grads = [tf.convert_to_tensor(g) for g in grads]
            summed = list(grads) if summed is None else [a + b for a, b in zip(summed, grads)]
        scale = self._loss_scale() if self._loss_scaled else None
        if scale is not None:  # fp16: the aggregator sees (and keeps state in) true units
            summed = [_scaled(g, 1.0 / scale) for g in summed]
        if started is not None:  # this replica's own part of the step ends here
            self._timer.ready(started, summed)
        if self._sync is None:
            summed = self._aggregate(summed, variables)
        else:  # DiLoCo: each replica steps on its own gradient (no all-reduce)
            summed = self._sync.local_gradients(summed, self.strategy.num_replicas_in_sync)
        if self.sum_sparse_rows:  # Adam & co. need a sparse gradient's rows summed first
            summed = [keras_fixes.sum_repeated_rows(g) for g in summed]
        if scale is not None:  # the LossScaleOptimizer divides by it (exactly: a power of 2)
            summed = [_scaled(g, scale) for g in summed]
        if self._guard is None:
            self.optimizer.apply(summed, variables)
        else:
            self._guard.apply(self.optimizer, summed, variables, index)
        if self._loss_sum is not None:
            self._loss_sum.assign_add(total)
        return total

    def _train_loop_fn(self, iterator, steps, phase=None):
        self.aggregator.set_phase(phase)  # e.g. compression warm-up: its own trace
        # The aggregator sums: Keras's optimizer must not, for this trace only (the caller's
        # optimizer is unchanged once it ends); the rows are summed here already.
        with private_api.trainer_step(self.optimizer, sharded_updates=self._async is not None), \
                optimizer_update.sparse_rows_summed(False):
            if self._async:
                return self._async_steps(iterator, steps)
            return self._synchronous_steps(iterator, steps)

    def _exchanging_loop_fn(self, iterator, steps, phase=None, fragments=(0,)):
        """The loop's steps with DiLoCo's overlapped exchange of `fragments` beside them: its
        collective reads what each replica sent at the round's end and writes the mean it
        receives, no variable the steps touch, so TensorFlow runs it while the steps compute."""
        self._sync.exchange(fragments)
        return self._train_loop_fn(iterator, steps, phase)

    def _async_steps(self, iterator, steps):
        """parameter_server: one replica per worker, so the reduce is local."""
        total = tf.constant(0.0)
        for _ in tf.range(steps):
            batches = [next(iterator) for _ in range(self.accumulate)]
            per_replica = self.strategy.run(self._replica_step, args=(batches,))
            total += self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return total / tf.cast(steps, tf.float32)

    def _synchronous_steps(self, iterator, steps):
        """(mean loss, bad steps, first bad step) of `steps` synchronous steps."""
        # Each replica adds its loss to its own copy; one cross-replica sum per call, so a
        # step's only collectives are the gradients' (see wire_bytes), and with a stateful
        # compressor one scalar (SkippedStepState; not under nonfinite="ignore").
        def reset():  # each replica its own copy: no collective
            for variable in (self._loss_sum, *self._guard.variables):
                variable.assign(0.0)
        self.strategy.run(reset)
        for index in tf.range(steps):
            started = self._timer.start() if self._timer is not None else None
            batches = [next(iterator) for _ in range(self.accumulate)]
            self.strategy.run(self._replica_step, args=(batches, index, started))
        return (self._loss_sum.read_value() / tf.cast(steps, tf.float32), *self._guard.read())

    # -- the loop ---------------------------------------------------------------------

    def _phase(self, step: int):
        return self.aggregator.phase(step)

    def _boundaries(self) -> tuple[int, ...]:
        return tuple(self.aggregator.boundaries())

    def train_steps(self, iterator, steps: int) -> float:
        """Runs `steps` optimizer steps from `iterator` from `self.step`; returns their mean
        loss. Under DiLoCo (`sync`) the calls are cut at the rounds' ends, where its outer
        step runs."""
        if self._sync is not None:
            with self._taking_up_the_weights():
                cuts = [self.step, *self._sync.cuts(self.step, self.step + steps), self.step + steps]
                total = 0.0
                for n in (b - a for a, b in zip(cuts, cuts[1:])):
                    total += self._train_call(iterator, n) * n
                    self._sync.after_call(self.step)
                return total / steps
        return self._train_call(iterator, steps)

    @contextlib.contextmanager
    def _taking_up_the_weights(self) -> Iterator[None]:
        """DiLoCo, outside a fit (a fit's own calls, evaluations and samples are inside it):
        the weights are checked for changes made outside the Trainer on entry (see
        DiLoCo.check_weights) and noted again on exit."""
        if self._sync is None or self._fitting:
            yield
            return
        self._sync.check_weights()
        self._fitting = True
        try:
            yield
        finally:
            self._fitting = False
            self._sync.note_weights()

    def _train_call(self, iterator, steps: int) -> float:
        """One call of `steps` steps (one tf.function call; scheduled under parameter_server)."""
        if self._async:
            loss = float(parameter_server.fetch(self._async.coordinator.schedule(
                self._scheduled_loop, args=(iterator, tf.constant(steps)))))
        else:
            loop = self._train_loop
            launched = self._sync.launches(self.step) if self._sync is not None else ()
            if launched:  # DiLoCo's exchange beside the steps
                loop = functools.partial(self._train_loop_exchanging, fragments=launched)
            loss, bad, first = loop(iterator, tf.constant(steps), self._phase(self.step))
            if self._batch_check is not None:
                self._batch_check.raise_if_differed()
            self._guard.after_call(bad, first, self.step)
            loss = float(loss)
        self.step += steps
        return loss

    def own_step_seconds(self) -> float | None:
        """This worker's own seconds in all steps so far (see `step_timer`; None: off)."""
        return None if self._timer is None else self._timer.local_seconds()

    def checkpoint_items(self) -> dict:
        """Trackables the Trainer adds to checkpoints (compression state), by name; with
        `shard`, also 'optimizer': the sharded optimizer state, in place of the optimizer."""
        items = self.aggregator.checkpoint_items()
        if self._sync is not None:
            items = {**items, **self._sync.checkpoint_items()}
        return items if self._sharded is None else {**items, **self._sharded.checkpoint_items()}

    def traced_step(self, dataset, phase=None):
        """The concrete function of one train step on `dataset` (for inspection)."""
        return self._train_loop.get_concrete_function(iter(dataset), tf.constant(1),
                                                      phase if phase is not None else self._phase(self.step))

    def wire_bytes(self, dataset, step: int | None = None) -> dict:
        """Bytes one replica hands to collectives per step, counted from the traced graph,
        and the ratio to one float32 all-reduce of every gradient. Collectives whose size
        depends on the data (sparse embedding gradients) are counted in
        `dynamic_collectives`, not in the bytes. `bytes_per_call`: what each call of
        `steps_per_loop` steps adds once (the cross-replica sum of the loss).
        `check_bytes_per_step`: the part of `bytes_per_step` that is not gradient: the one
        float32 with which replicas agree that every gradient is finite (with a stateful
        compressor, see tfpar.loop.nonfinite.SkippedStepState).

        `step`: count the step traced for that step's phase (default: the current step;
        e.g. the last step of a run, after a compression warm-up has ended)."""
        traced = self.traced_step(dataset, None if step is None else self._phase(step))
        found = accounting.collectives(traced)
        sent = accounting.bytes_per_replica(traced, in_loops_only=True)
        if self._sync is not None:  # DiLoCo: the outer step's all-reduce, spread over its round
            sent += self._sync.bytes_per_round() / self._sync.inner_steps
        dense = accounting.fp32_bytes(self.model.trainable_variables)
        return {"bytes_per_step": sent, "fp32_bytes_per_step": dense,
                "ratio": dense / sent if sent else float("inf"),
                "bytes_per_call": accounting.bytes_per_replica(traced) - sent,  # the loss sum
                "check_bytes_per_step": accounting.bytes_in_scope(found),
                "dynamic_collectives": len(accounting.dynamic(found))}

    def _chunks(self, start: int, end: int) -> list[int]:
        """Step counts per tf.function call: steps_per_loop, cut at phase boundaries (with a
        controller, `fit` takes the controller's plan instead, cut at its intervals too)."""
        rounds = self._sync.cuts(start, end) if self._sync is not None else ()
        cuts = sorted({*range(start, end, self.steps_per_loop), end, *rounds,
                       *(b for b in self._boundaries() if start < b < end)})
        return [b - a for a, b in zip(cuts, cuts[1:])]

    def per_worker_dataset(self, dataset_fn):
        """parameter_server only: `dataset_fn()` built on every worker, for `fit`.

        Each worker reads its own copy; give it its own order (e.g. a shuffle seeded per
        worker, see tfpar.data.worker_train_fn), or every worker sees the same batches.
        """
        if not self._async:
            raise TrainerError("per_worker_dataset is for parameter_server; use "
                               "strategy.distribute_datasets_from_function otherwise.")
        return self._async.per_worker_dataset(dataset_fn)

    def _run_chunks(self, iterator, sizes: list[int], on_chunk, settle=frozenset(),
                    around=None) -> None:
        """Runs a call per size, then `on_chunk(size, mean loss)` with `self.step` past it;
        `around(steps)`: a context around each call (a controller's profile window).

        Under parameter_server the calls are scheduled on the workers and stay in flight,
        except at a step in `settle` (a checkpoint or evaluation reads the state there):
        every call before it has finished when its `on_chunk` runs.
        """
        if not self._async:
            for n in sizes:  # cut at DiLoCo's round ends: its outer step runs before on_chunk (checkpoints)
                with around(n) if around is not None else contextlib.nullcontext():
                    loss = self.train_steps(iterator, n)
                on_chunk(n, loss)
            return

        def done(n: int, loss: float) -> None:
            self.step += n
            on_chunk(n, loss)

        part, step = [], self.step
        for index, n in enumerate(sizes):
            part.append(n)
            step += n
            if step in settle or index == len(sizes) - 1:
                self._async.run(self._scheduled_loop, iterator, part, done)
                part = []

    def fit(self, dataset, steps: int, start_step: int = 0,
            callbacks: Sequence[keras.callbacks.Callback] = (), controller=None) -> dict:
        """Trains from `start_step` to `steps`; returns {"loss": mean loss of those steps}.
        As Keras fit ends, an optimizer with `use_ema` then puts its moving averages in the
        model (`finalize_variable_values`).

        Args:
          dataset: a distributed dataset (parameter_server: from `per_worker_dataset`).
          callbacks: Keras callbacks, called as `fit` would for one epoch whose batch b is
            step `start_step + b + 1` (after each call of `steps_per_loop` steps).
          controller: a tfpar.controller.Controller at `start_step` that ends at `steps`:
            it plans the calls (so its intervals land on their steps) and does the outer
            loop's work (progress, eval, checkpoints, preemption) after each.

        Example:
            >>> trainer.fit(data, steps=1000, controller=Controller(total_steps=1000, ...))
        """
        if controller is not None and (controller.step, controller.total_steps) != (start_step, steps):
            raise TrainerError(f"The controller is at step {controller.step} of "
                               f"{controller.total_steps}; fit was asked for {start_step} to {steps}.")
        callback_list = keras.callbacks.CallbackList(list(callbacks), model=self.model)
        self.step, mean, logs = start_step, _RunningMean(), {}
        if controller is None:
            sizes, settle = self._chunks(start_step, steps), frozenset()
        else:
            sizes, settle = controller.plan(self._boundaries()), controller.settle_steps()
            controller.begin()

        def on_chunk(n: int, loss: float) -> None:
            nonlocal logs
            logs = {"loss": mean.add(loss, n)}
            callback_list.on_train_batch_end(self.step - start_step - 1, logs)
            if controller is not None:
                controller.after_steps(n, loss)

        if self._batch_check is not None:
            self._batch_check.arm()
        callback_list.on_train_begin()
        callback_list.on_epoch_begin(0)
        iterator = iter(self._distributed(dataset))
        if controller is not None and controller.profile is not None:  # its comm log's bytes
            controller.profile_collectives = lambda: self.step_collectives(iterator)
        with self._taking_up_the_weights():
            self._run_chunks(iterator, sizes, on_chunk, settle, controller and controller.running)
        callback_list.on_epoch_end(0, logs)
        if sizes and self._sharded is not None:  # as Keras fit ends: with use_ema the model
            self._sharded.finalize(self.model.trainable_variables)  # takes the moving averages
        elif sizes:
            self.optimizer.finalize_variable_values(self.model.trainable_variables)
        callback_list.on_train_end(logs)
        return logs

    def _distributed(self, dataset):
        """A plain tf.data.Dataset distributed by the strategy (each replica a slice of each
        global batch); a distributed one as it is."""
        if isinstance(dataset, tf.data.Dataset) and self.strategy.num_replicas_in_sync > 1 and not self._async:
            return self.strategy.experimental_distribute_dataset(dataset)
        return dataset

    def evaluate(self, dataset, steps: int) -> dict:
        """Exact loss (cross-entropy), perplexity, accuracy and exact-match over `steps` batches
        of (x, y, weight), reduced over all replicas (see tfpar.evaluation). Under
        parameter_server the chief evaluates on its own: `dataset` is then a plain one (or
        one distributed by the default strategy), the variables are read from the ps."""
        with self.shared_weights():  # DiLoCo: the shared weights, not each replica's own
            return self._evaluate(dataset, steps)

    def shared_weights(self) -> contextlib.AbstractContextManager:
        """Inside, the model holds the weights every replica shares (under DiLoCo the outer
        weights, mid-round too; each replica its own copy again after); otherwise nothing
        changes. Sample, export or save a DiLoCo model inside it.

        Example:
            >>> with trainer.shared_weights():
            ...     model.save_weights("/tmp/shared.weights.h5")
        """
        if self._sync is None:
            return contextlib.nullcontext()
        if not self._fitting:
            self._sync.check_weights()
        return self._sync.shared_weights()

    def _evaluate(self, dataset, steps: int) -> dict:
        strategy = tf.distribute.get_strategy() if self._async else self.strategy
        local = not self._async and strategy.num_replicas_in_sync == 1  # XLA: variables here
        layout = self._tensor_layout
        check, prepare = self._evaluation_hooks
        results = evaluation.evaluate(self.model, strategy, self._distributed(dataset), steps,
                                      xla=self.xla and local, batch_check=check, prepare=prepare)
        if layout is None:
            return results
        if results.pop("batch_check", 0):
            raise tensor_parallel.mismatch_error(layout, "The evaluation dataset")
        return {**results, "examples": results["examples"] / layout.degree}  # a TP group's T replicas see each

    def step_collectives(self, iterator) -> list:
        """The collectives (tfpar.compression.accounting.Collective) of the one-step call
        that trained the last step on `iterator`, with their counted bytes."""
        return accounting.collectives(self._train_loop.get_concrete_function(
            iterator, tf.constant(1), self._phase(max(self.step - 1, 0))))

    def collective_ops(self, dataset) -> list[tuple[str, str]]:
        """(type, name) of every collective op in one traced train step, nested functions
        included: the evidence that gradients cross the wire once, in the aggregator."""
        return [(c.type, c.name) for c in accounting.collectives(self.traced_step(dataset))]


def _shard_of(model, strategy, asked):
    """The shard mode: `asked`, or what the model's keras.distribution plan gives (said in
    one line at start; "none" without a plan)."""
    plan = getattr(strategy, "_tfpar_plan", None)
    if plan is None:
        return "none" if asked is None else asked
    shard = plan.shard_for(model, asked)
    logging.info("tfpar: %s", plan.start_line(model, shard))
    return shard


@contextlib.contextmanager
def _naming_the_default(by_default: bool):
    """A ZeRO refusal of the layout map's default ZeRO-2 also names the way out."""
    try:
        yield
    except ShardingError as e:
        if not by_default:
            raise
        raise ShardingError(f"{e} (ZeRO-2 is the Trainer's default for a model whose keras.distribution layout "
                            "map lays weights on the batch axis: pass shard='none' to keep their optimizer "
                            "state whole.)") from None
