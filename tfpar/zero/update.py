"""Sharded data parallelism (ZeRO-1 and ZeRO-2) in tfpar's loop: `Trainer(shard=...)`.

Each replica updates only its own 1/R of the parameters (a chunk of every variable, see
tfpar.zero.partitions) with its own 1/R of the optimizer state (the user's Keras
optimizer run on the chunks, tfpar.zero.optimizer), and the updated chunks are
all-gathered back into every replica's copy of the model. Per step:

    gradients --reduce-scatter--> this replica's chunk of their sum
              --one small all-reduce--> the global norm (clipping) and one finiteness flag
              --Keras's update on the chunk--> new chunk --all-gather--> whole variables

The reduce-scatter plus the all-gather carry what one all-reduce carries ((R - 1)/R of the
parameters each way on a ring). The modes:

- "optimizer" (ZeRO-1): micro-batches (Trainer(accumulate=K)) are summed in full, then
  reduce-scattered once a step. With a compression that needs the whole sum on every
  replica (topk, int8, sign, powersgd) the compression aggregates as without sharding and
  each replica keeps its chunk of the sum.
- "gradients" (ZeRO-2): every micro-batch is reduce-scattered, bucket by bucket, right after
  its backward pass, and only this replica's chunk is accumulated: 1/R of the gradients is
  held between micro-batches (at the price of one reduce-scatter per micro-batch).

The optimizer state is checkpointed in Keras's own layout, each replica writing its own
slices (tfpar.zero.checkpoint; one file per worker across workers, tfpar.zero.files), and
the caller's optimizer object saves and loads it too (tfpar.zero.own_optimizer).

A tensor-parallel model (R data-parallel groups x T, tfpar.tensor_parallel; the Trainer
calls `split_over(layout)`) is partitioned over each data-parallel (DP) group: the R
replicas that hold the same shards. Each keeps 1/R of its shard's state (1/(R x T) of the
whole weight's) and 1/R of every replicated weight's (the same chunks on every TP rank).
The Trainer divides each replica's loss by N = R x T, so per step:

    split weight:       gradient x T            --reduce-scatter over the DP group-->
    replicated weight:  --all-reduce over the TP group--> --reduce-scatter over the DP group-->
    norm^2 = sum of the split chunks' squares + sum of the replicated chunks' squares / T
             (each split chunk is owned once; a replicated one once per TP rank), one
             all-reduce over every replica (with the finiteness flag)
    update of the chunks --all-gather over the DP group--> each replica's own shard whole

Every TP rank reduce-scatters the same bits of a replicated gradient (the all-reduce gives
every member one sum) and sums the rows in one order, so the replicated weights stay
bit-identical on every replica. Refused with it: LAMB and clipnorm (each needs norms of
whole variables), compression, and what tensor parallelism refuses.

What a step does not change: Keras's clip (global_clipnorm with the norm of the whole
gradient, clipnorm with each variable's whole norm, clipvalue), decoupled weight decay
and its exclusions, schedules, EMA, fp16's dynamic loss scale (one agreed flag: every
replica keeps the same scale) and the Trainer's non-finite policies.

Example:
    >>> trainer = tfpar.Trainer(model, keras.optimizers.AdamW(1e-3), loss, strategy=strategy,
    ...                         shard="gradients", accumulate=4)
    >>> check_shard("gradients", "mirrored", compression="topk")   # ShardingError, by name
    >>> tp_model = GPT(..., tensor_parallel=2)        # under mirrored over 4 devices
    >>> tfpar.Trainer(tp_model, keras.optimizers.AdamW(1e-3), loss, shard="optimizer")   # 2 x 2
"""

from __future__ import annotations

import collections

import keras
import tensorflow as tf

from tfpar.compression import accounting
from tfpar.errors import ShardingError
from tfpar.zero import checkpoint as zero_checkpoint
from tfpar.zero import own_optimizer
from tfpar.strategy import groups, private_api
from tfpar.tensor_parallel.shards import spec_of
from tfpar.zero.checks import (GRADIENTS, MODES, NONE, OPTIMIZER, WIRE_DTYPE_ONLY,  # noqa: F401
                               check_shard, check_split_model, check_variable, compression_name)
from tfpar.zero.partitions import BUCKET_BYTES, PartitionGroups, PartitionLayout
from tfpar.zero.optimizer import PartitionedOptimizer

GRADIENT_SCOPE = "tfpar_gradients_held"  # the gradient buffer a step holds until its update


def _agreed_sum(group, vector: tf.Tensor) -> tf.Tensor:
    """A small all-reduce that carries no gradient (norms, the finiteness flag): named like
    the Trainer's finiteness check, so wire_bytes counts it as `check_bytes_per_step`."""
    with tf.name_scope(accounting.CHECK_SCOPE):
        return group.all_reduce(vector)


def _held(tensors: list) -> list:
    """Marks the gradient buffer a step holds until its update (counted by `held_bytes`)."""
    with tf.name_scope(GRADIENT_SCOPE):
        return [tf.identity(t) for t in tensors]


class ZeroUpdate:
    """The Trainer's sharded update: build it with `Trainer(shard=ZeroUpdate(mode, ...))`
    to choose the bucket size; `Trainer(shard=mode)` makes one (see module docstring).

    Args:
      mode: 'optimizer' (ZeRO-1) or 'gradients' (ZeRO-2).
      bucket_bytes: the largest full-size rows one reduce-scatter or all-gather sends at once.
    """

    def __init__(self, mode: str, bucket_bytes: int = BUCKET_BYTES):
        if check_shard(mode) == NONE:
            raise ShardingError("ZeroUpdate('none') shards nothing: pass shard='none' to the Trainer.")
        self.mode, self.bucket_bytes = mode, bucket_bytes
        self.shard = self.layout = self.strategy = self._aggregator = self.groups = None
        self.tensor_layout = None
        self._ranks, self._split, self._policy, self._view = {}, [], "stop", None

    def split_over(self, tensor_layout) -> None:
        """The model is split over `tensor_layout` (a tfpar.tensor_parallel.Layout): its
        chunks are partitioned over each data-parallel group (see module docstring). Call
        it before `configure`."""
        self.tensor_layout = tensor_layout

    def configure(self, strategy, optimizer, aggregator, placement, nonfinite: str) -> None:
        """Checks the Trainer's options (ShardingError by name) before anything is built."""
        from tfpar.aggregation import AllReduce  # pylint: disable=import-outside-toplevel
        from tfpar.compression import Compression  # pylint: disable=import-outside-toplevel
        from tfpar.strategy.describe import strategy_kind  # pylint: disable=import-outside-toplevel

        check_shard(self.mode, strategy_kind(strategy), aggregator if isinstance(aggregator, Compression)
                    else None, placement)
        if self.tensor_layout is not None:  # its own sums (see module docstring), no aggregator's
            check_split_model(self.mode, optimizer, aggregator)
            self._aggregator = None
        elif not isinstance(aggregator, (AllReduce, Compression)) and self.mode == GRADIENTS:
            raise ShardingError(f"shard='gradients' with the aggregator {type(aggregator).__name__}: an "
                                "aggregator returns the whole sum, which ZeRO-2 never holds. Use "
                                "shard='optimizer' (the aggregator's sum, then each replica's chunk).")
        else:
            self._aggregator = None if isinstance(aggregator, AllReduce) else aggregator
        self.strategy, self._policy = strategy, nonfinite
        self.shard = PartitionedOptimizer(optimizer)

    def build(self, variables) -> None:
        """Under `strategy.scope()`: the groups and their ranks, the layout, the optimizer
        on the chunks."""
        for variable in variables:
            check_variable(variable)
        self.groups = PartitionGroups(self.strategy, self.tensor_layout)
        self.layout = PartitionLayout(variables, self.groups.replicas, self.bucket_bytes)
        self._ranks = self.groups.ranks
        specs = [spec_of(v) if self.tensor_layout is not None else None for v in variables]
        self._split = [s is not None for s in specs]
        self.shard.build(self.layout, variables)
        owners = zero_checkpoint.Owners(self._ranks, self.groups.tensor_ranks, tuple(specs))
        self._view = zero_checkpoint.optimizer_view(self.shard, self.layout, owners)
        own_optimizer.take_built_state(self.shard, self._view)  # e.g. after keras.models.load_model
        own_optimizer.stand_in(self.shard, self._view)  # the caller's optimizer saves the partitions

    # -- the step (replica context) ------------------------------------------------------

    def loss_scale(self) -> tf.Tensor:
        """fp16: the dynamic loss scale (1.0 otherwise)."""
        return tf.constant(1.0) if self.shard.scale is None else tf.identity(self.shard.scale)

    def replica_step(self, passes, variables, index, guard, aggregate) -> tf.Tensor:
        """One step on this replica: `passes` yields (loss, gradients) per micro-batch,
        `aggregate` is the Trainer's aggregator (with its skipped-step state); returns the
        summed loss."""
        replica = groups.here()
        comm = self.groups.partition(replica)
        unscale = None if self.shard.scale is None else 1.0 / self.loss_scale()
        total = full = shard = updated = None
        for loss, grads in passes:
            total = loss if total is None else total + loss
            updated = [g is not None for g in grads]
            grads = [self._dense(g, v, unscale) for g, v in zip(grads, variables)]
            if self.mode == GRADIENTS:
                part = self._scatter(replica, self._tensor_parallel_sums(replica, grads))
                shard = part if shard is None else [a + b for a, b in zip(shard, part)]
            else:
                full = grads if full is None else [a + b for a, b in zip(full, grads)]
        if self.mode == OPTIMIZER:
            if self._scatters():
                shard = self._scatter(replica, self._tensor_parallel_sums(replica, _held(full)))
            else:  # the aggregator's whole sum, then this replica's chunk
                summed = aggregate(_held(full), variables)
                shard = [self.layout.chunk(tf.convert_to_tensor(s), i, comm.rank()) for i, s in enumerate(summed)]
        else:
            shard = _held(shard)
        self._update(replica, shard, updated, variables, index, guard)
        return total

    @staticmethod
    def _dense(gradient, variable, unscale):
        if gradient is None:  # Keras leaves such a variable alone (see PartitionedOptimizer.apply)
            return tf.zeros(variable.shape, variable.dtype)
        # a sparse gradient: its rows summed, dense, with the variable's static shape
        gradient = tf.ensure_shape(tf.convert_to_tensor(gradient), variable.shape)
        return gradient if unscale is None else gradient * tf.cast(unscale, gradient.dtype)

    def _scatters(self) -> bool:
        return self._aggregator is None or compression_name(self._aggregator) in WIRE_DTYPE_ONLY

    def _plan(self) -> list:
        """The compressor per variable in the traced phase (None: float32 as it is)."""
        if self._aggregator is None:
            return [None] * len(self.layout.sizes)
        plan = self._aggregator._plan_for(self._aggregator._phase)  # pylint: disable=protected-access
        return [c if c is not None and c.wire_dtype != tf.float32 else None for c in plan]

    def _tensor_parallel_sums(self, replica: int, grads: list) -> list:
        """A tensor-parallel model's gradients made ready for the DP group's reduce-scatter:
        a split weight's times T, a replicated weight's summed over the TP group (one
        packed all-reduce: every rank then holds the same bits). As they are without."""
        tensor = self.groups.tensor(replica)
        if tensor is None:
            return grads
        found = [g * tf.cast(tensor.size, g.dtype) if split else g for g, split in zip(grads, self._split)]
        whole = [i for i, split in enumerate(self._split) if not split]
        if whole:
            with tf.name_scope("tensor_parallel/replicated_sum"):
                for i, summed in zip(whole, tensor.batch_all_reduce([grads[i] for i in whole])):
                    found[i] = summed
        return found

    def _scatter(self, replica: int, grads: list) -> list:
        """Whole gradients -> this replica's chunk of their sum over its partition group,
        one [c_i] per variable, one reduce-scatter per bucket (in the compression's wire
        dtype, if any)."""
        comm = self.groups.partition(replica)
        plan, replicas = self._plan(), comm.size
        wire = [c.wire_dtype if c else d for c, d in zip(plan, self.layout.dtypes)]
        pieces = [None] * len(grads)
        for bucket in self.layout.buckets_for(wire):
            sent = {i: plan[i].encode(grads[i], replicas) if plan[i] else grads[i] for i in bucket}
            summed = comm.reduce_scatter(self.layout.rows(sent, bucket))  # (C,)
            for i, part in zip(bucket, self.layout.split(summed, bucket)):
                pieces[i] = plan[i].decode(part, replicas) if plan[i] else part
        return pieces

    def _squares(self, shard: list) -> list:
        """Each chunk's sum of squares, as its share of the whole gradient's: a replicated
        weight's chunks repeat on every TP rank, so they count 1/T each."""
        squares = [tf.reduce_sum(tf.square(g)) for g in shard]
        if self.tensor_layout is None:
            return squares
        degree = float(self.tensor_layout.degree)
        return [s if split else s / degree for s, split in zip(squares, self._split)]

    def _agree(self, shard: list) -> dict:
        """One all-reduce over every replica of what every replica must agree on: the
        squared norms (global or per variable, for clipping and the finiteness flag) and,
        under fp16, the count of non-finite scaled gradients (Keras's LossScaleOptimizer
        test). {} if none is needed."""
        base, fp16 = self.shard.base, self.shard.scale is not None
        per_variable = bool(base.clipnorm and base.clipnorm > 0)
        norm = per_variable or bool(base.global_clipnorm) or (self._policy != "ignore" and not fp16)
        if not (norm or fp16):
            return {}
        vector = []
        if norm:
            squares = self._squares(shard)
            vector += squares if per_variable else [tf.add_n(squares)]
        if fp16:
            vector.append(tf.add_n([tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(g * self.shard.scale)),
                                                          tf.float32)) for g in shard]))
        summed = _agreed_sum(self.groups.world, tf.stack(vector))
        found = {}
        if norm:
            found["each"] = summed[:len(shard)] if per_variable else None
            found["total"] = tf.reduce_sum(summed[:len(shard)]) if per_variable else summed[0]
        found["finite"] = tf.equal(summed[-1], 0.0) if fp16 else tf.math.is_finite(found["total"])
        return found

    def _update(self, replica: int, shard, updated, variables, index, guard) -> None:
        agreed = self._agree(shard)
        finite = agreed.get("finite")
        fp16 = self.shard.scale is not None
        if self._policy in ("stop", "skip") and not fp16:
            guard.note(finite, index)
        grads = self.shard.clip(shard, agreed)
        comm = self.groups.partition(replica)
        if self._policy == "skip" or fp16:
            tf.cond(finite, lambda: self._apply(comm, grads, updated, variables) or tf.constant(True),
                    lambda: tf.constant(False))
        else:
            self._apply(comm, grads, updated, variables)
        if fp16:
            self.shard.update_scale(finite)

    def _apply(self, comm, grads, updated, variables) -> None:
        """The optimizer on this replica's chunks, then every variable whole again."""
        rank = comm.rank()
        for i, (variable, piece) in enumerate(zip(variables, self.shard.pieces)):
            piece.assign(self.layout.chunk(tf.convert_to_tensor(variable.value), i, rank))
        self.shard.apply(grads, updated, lambda vector: _agreed_sum(comm, vector))
        self._gather_into(comm, self.shard.pieces, variables, constrain=True)
        private_api.local_component(self.shard.base._iterations).assign_add(1)  # pylint: disable=protected-access

    def _gather_into(self, comm, pieces, variables, constrain: bool) -> None:
        """Every chunk of the partition group, all-gathered bucket by bucket, written whole
        into this replica's copy of each variable (every member writes the same values)."""
        for bucket in self.layout.buckets:
            mine = tf.concat([tf.convert_to_tensor(pieces[i]) for i in bucket], 0)
            rows = comm.all_gather_same_shape(mine[None])  # (R, C): row k from rank k
            for i, whole in zip(bucket, self.layout.unrows(rows, bucket)):
                constraint = getattr(variables[i], "constraint", None)
                if constrain and constraint is not None:  # Keras: after the update, on the whole
                    whole = constraint(whole)
                private_api.local_component(variables[i]).assign(whole)

    # -- around the steps ----------------------------------------------------------------

    def finalize(self, variables) -> None:
        """As Keras fit ends: with use_ema, the model takes the moving averages (gathered)."""
        if not self.shard.base.use_ema:
            return

        def replica():
            comm = self.groups.partition(groups.here())
            self._gather_into(comm, self.shard.averages(), variables, constrain=False)

        tf.function(lambda: self.strategy.run(replica))()

    def checkpoint_items(self) -> dict:
        """{'optimizer': the sharded optimizer, in Keras's checkpoint layout} (see
        tfpar.zero.checkpoint): pass it where the optimizer would go. The caller's own
        optimizer object saves the same (tfpar.zero.own_optimizer)."""
        return {"optimizer": self._view}

    def state_variables(self) -> list:
        """Every variable the optimizer's state lives in: the slots and counters of the
        optimizer on the chunks, the step counter and learning rate it shares with the
        caller's optimizer, fp16's scale."""
        shard = self.shard
        own = shard.clone.variables[shard.own_variables:]
        shared = [shard.base._iterations, shard.base._learning_rate]  # pylint: disable=protected-access
        scale = [shard.scale, shard.counter]
        return [v for v in (*own, *shared, *scale) if isinstance(v, (tf.Variable, keras.Variable))]


def zero_update(shard) -> ZeroUpdate | None:
    """The Trainer's `shard` option as a ZeroUpdate (None: 'none'); a wrong name is refused."""
    if isinstance(shard, ZeroUpdate):
        return shard
    return None if check_shard(shard) == NONE else ZeroUpdate(shard)


def state_bytes(trainer) -> dict:
    """Bytes one replica holds (the busiest device), read from the variables a Trainer
    created: 'parameters' (the model's trainable variables), 'optimizer_state' (Keras's
    optimizer, or the sharded one's chunks) and, sharded, 'parameter_shard' (the chunks
    the update writes)."""
    sharded = trainer._sharded  # pylint: disable=protected-access
    state = trainer.optimizer.variables if sharded is None else sharded.state_variables()
    found = {"parameters": _busiest(device_bytes(trainer.model.trainable_variables)),
             "optimizer_state": _busiest(device_bytes(state))}
    if sharded is not None:
        found["parameter_shard"] = _busiest(device_bytes(sharded.shard.pieces))
    return found


def device_bytes(variables) -> collections.Counter:
    """Bytes of `variables` per device, from every copy actually created (a mirrored or
    per-replica variable: one copy per replica)."""
    found = collections.Counter()
    for variable in variables:
        variable = variable.value if isinstance(variable, keras.Variable) else variable
        copies = variable.values if isinstance(variable, tf.distribute.DistributedValues) else [variable]
        for copy in copies:
            found[copy.device] += int(copy.shape.num_elements()) * tf.as_dtype(copy.dtype).size
    return found


def _busiest(by_device: collections.Counter) -> int:
    return max(by_device.values(), default=0)


def held_gradient_bytes(concrete_function) -> int:
    """Bytes of the gradient buffer one replica's step holds until its update (the busiest
    device), read from the traced step: the tensors marked GRADIENT_SCOPE by the sharded
    update; an unsharded step holds what its all-reduce sends (the float32 gradients)."""
    per_device = collections.Counter()
    for graph in accounting.graphs(concrete_function):
        for op in graph.get_operations():
            if op.type == "Identity" and accounting.in_scope(op.name, GRADIENT_SCOPE):
                shape = op.outputs[0].shape
                if shape.is_fully_defined():
                    per_device[op.device] += int(shape.num_elements()) * op.outputs[0].dtype.size
    if per_device:
        return _busiest(per_device)
    return int(accounting.bytes_per_replica(concrete_function, in_loops_only=True, checks=False))
