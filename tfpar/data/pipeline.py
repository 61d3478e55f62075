"""The one place a dataset becomes a distributed one.

- global batch -> per-replica batch (a clear error when it does not divide);
- `strategy.distribute_datasets_from_function`: one input pipeline per worker;
- FILE sharding when the source has at least one file per pipeline, else DATA sharding,
  with the reason logged;
- `drop_remainder=True` for training (static shapes for TPUs and XLA), a start step to
  resume at the exact data position;
- evaluation that pads the last global batch with zero-weight examples, so every
  validation example is counted exactly once on any number of replicas and workers.

Example:
    >>> train = distribute_train(strategy, splits.train, global_batch=64)
    >>> valid, steps = distribute_eval(strategy, splits.validation, global_batch=64)
    >>> per_worker = trainer.per_worker_dataset(worker_train_fn(splits.train, 64))  # ps
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from tfpar.data.source import Shard, Source
from tfpar.errors import DataError


def per_replica_batch_size(global_batch: int, replicas: int) -> int:
    if global_batch < 1 or global_batch % replicas:
        raise DataError(
            f"Global batch {global_batch} does not divide over {replicas} replicas. Use a "
            f"multiple of {replicas} (e.g. --config.train.batch_size="
            f"{max(replicas, global_batch // replicas * replicas)})."
        )
    return global_batch // replicas


def choose_shard(source: Source, context: tf.distribute.InputContext) -> Shard:
    """FILE sharding when every pipeline can get its own files, else DATA sharding."""
    num, index = context.num_input_pipelines, context.input_pipeline_id
    if num == 1:
        return Shard()
    by_file = source.num_files >= num
    reason = (f"{source.num_files} files >= {num} input pipelines" if by_file else
              f"{source.num_files} files < {num} input pipelines: every pipeline reads all, keeps 1/{num}")
    logging.info("tfpar: %s sharding for %s (%s).", "FILE" if by_file else "DATA", source.name, reason)
    return Shard(num=num, index=index, by_file=by_file)


def same_batch_for_groups(dataset: tf.data.Dataset, group: int) -> tf.data.Dataset:
    """Each element `group` times in a row: the local replicas take consecutive elements,
    so the `group` replicas of a tensor-parallel group all get the same batch."""
    if group == 1:
        return dataset
    return dataset.flat_map(lambda *batch: tf.data.Dataset.from_tensors(batch).repeat(group))


def group_inputs(strategy: tf.distribute.Strategy, context: tf.distribute.InputContext,
                 tensor_parallel: int) -> tuple[tf.distribute.InputContext, int, int]:
    """(the input context of the tensor-parallel groups, distinct batches this pipeline
    makes per step, how many replicas here take each): a group of T replicas sees one batch.
    When a group spans input pipelines (workers with fewer than T replicas each), those
    pipelines read the same shard.

    Example:
        >>> group_inputs(strategy, context, 2)   # 2 workers of 1 replica: one shard, (ctx, 1, 1)
    """
    local = strategy.num_replicas_in_sync // context.num_input_pipelines
    if tensor_parallel <= local:
        return context, local // tensor_parallel, tensor_parallel
    span = tensor_parallel // local  # input pipelines per group
    grouped = tf.distribute.InputContext(context.num_input_pipelines // span, context.input_pipeline_id // span,
                                         strategy.num_replicas_in_sync)
    return grouped, 1, local


def distribute_train(
    strategy: tf.distribute.Strategy,
    source: Source,
    global_batch: int,
    start_step: int = 0,
    augment: Optional[Callable] = None,
    tensor_parallel: int = 1,
):
    """An endless, distributed training dataset that starts at `start_step`. With
    `tensor_parallel` = T, the global batch is split over the replicas / T tensor-parallel
    groups and every replica of a group gets its group's batch."""
    per_replica = per_replica_batch_size(global_batch, strategy.num_replicas_in_sync // tensor_parallel)
    if source.num_examples is not None and source.num_examples < global_batch:
        raise DataError(
            f"{source.name} has {source.num_examples} training examples, fewer than one global "
            f"batch of {global_batch}: every batch would be dropped. Lower "
            f"--config.train.batch_size (at most {source.num_examples}) or give more data.")

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        context, groups_here, repeats = group_inputs(strategy, context, tensor_parallel)
        dataset = source.build(choose_shard(source, context), training=True)
        if augment is not None:
            dataset = dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        dataset = dataset.batch(per_replica, drop_remainder=True)
        if start_step:
            dataset = dataset.skip(start_step * groups_here)
        return same_batch_for_groups(dataset, repeats).prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(dataset_fn)


def worker_train_fn(source: Source, batch_size: int, augment: Optional[Callable] = None
                    ) -> Callable[[], tf.data.Dataset]:
    """parameter_server: a dataset function each worker runs for itself (batch per step).

    The coordinator traces the function once and runs the same graph on every worker, so
    a seeded shuffle alone would give every worker the same batches. Each worker (and a
    restarted one) starts at its own offset into the endless shuffled stream, taken from
    the clock when it builds its iterator. Asynchronous training does not replay data
    exactly: on resume the weights and the step are restored, the order is new.
    """
    period = max(source.num_examples or 0, 1)

    def dataset_fn() -> tf.data.Dataset:
        dataset = source.build(Shard(), training=True)
        offset = tf.cast(tf.timestamp() * 1e6, tf.int64) % period
        dataset = dataset.skip(offset)
        if augment is not None:
            dataset = dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
        return dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    return dataset_fn


def _with_weight(*example):
    if len(example) == 3:
        return example
    x, y = example
    return x, y, tf.ones_like(y, dtype=tf.float32)


def count_examples(dataset: tf.data.Dataset) -> int:
    count = int(dataset.cardinality())
    if count >= 0:
        return count
    return int(dataset.reduce(0, lambda n, _: n + 1))


def distribute_eval(strategy: tf.distribute.Strategy, source: Source, global_batch: int,
                    limit: int = 0, tensor_parallel: int = 1):
    """(distributed dataset of (x, y, weight), steps): each example exactly once.

    The validation set is padded to a multiple of the global batch with copies of its
    first example at weight 0, batched per replica, and the batches dealt out to the
    input pipelines, so every pipeline runs the same number of steps. `limit` > 0 keeps
    only the first `limit` validation examples (a fixed, deterministic subset). With
    `tensor_parallel` = T every replica of a tensor-parallel group gets its group's batch
    (a sum over replicas then counts each example T times: divide by T).
    """
    per_replica = per_replica_batch_size(global_batch, strategy.num_replicas_in_sync // tensor_parallel)

    def examples() -> tf.data.Dataset:
        dataset = source.build(training=False).map(_with_weight)
        return dataset.take(limit) if limit > 0 else dataset

    count = count_examples(examples())
    if count == 0:
        raise DataError(f"The validation set {source.name} is empty.")
    steps = -(-count // global_batch)
    padding = steps * global_batch - count

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = examples()
        if padding:
            filler = dataset.take(1).map(lambda x, y, w: (x, y, tf.zeros_like(w)))
            dataset = dataset.concatenate(filler.repeat(padding))
        dataset = dataset.batch(per_replica, drop_remainder=True)
        context, _, repeats = group_inputs(strategy, context, tensor_parallel)
        if context.num_input_pipelines > 1:
            dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        return same_batch_for_groups(dataset, repeats).prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(dataset_fn), steps
