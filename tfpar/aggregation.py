"""The gradient-aggregation seam of tfpar's loop: one declared contract, below its users.

The loop (tfpar.loop), compression (tfpar.compression) and ZeRO (tfpar.zero) all look down
to this module; it imports none of them.

An aggregator receives this replica's gradients in the replica context and returns the
gradients summed over all replicas. The Trainer calls it exactly once per step and then
applies the optimizer with Keras's own all-reduce off (tfpar.strategy.private_api).
Gradient compression (tfpar.compression) plugs in here.

Every hook the Trainer calls is declared on `GradientAggregator` with a no-op default, so
an aggregator overrides only what it needs and the Trainer never probes with `hasattr`:

- `check_optimizer(optimizer)`: at construction; refuses an optimizer the aggregator's
  gradients cannot go to, and reads what it needs of it (1-bit Adam takes Adam's betas,
  epsilon and clipping; DGC takes SGD's momentum).
- `build(variables)`: once, under `strategy.scope()`, before any step is traced.
- `optimizer_for(optimizer)`: after `build`, the Keras optimizer that applies what the
  aggregator returns: the same one, or (an aggregator that computes Adam's or momentum's
  step itself) a plain SGD with its learning rate, schedule, weight decay and EMA.
- `boundaries()`: steps at which `phase` changes; the Trainer cuts its runs there.
- `phase(step)`: a hashable value; each distinct phase gets its own trace of the step.
- `set_phase(phase)`: called while tracing, before `__call__`, with that trace's phase.
- `checkpoint_items()`: trackables (by name) saved and restored with the model.
- `state_variables()`: per-replica state that a skipped step must leave as it was
  (error feedback, a compressor's moments); see tfpar.loop.nonfinite.SkippedStepState.
  Declaring any also adds one scalar all-reduce a step (the replicas agree that every
  gradient is finite), except under nonfinite="ignore".

Example:
    >>> class Mine(GradientAggregator):
    ...     def __call__(self, gradients, variables):
    ...         ctx = tf.distribute.get_replica_context()
    ...         return ctx.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
"""

from __future__ import annotations

import abc
from typing import Hashable, Sequence

import tensorflow as tf

from tfpar.strategy.replicas import communicates, multi_worker  # noqa: F401  (re-exported)


class GradientAggregator(abc.ABC):
    """Base class: per-replica gradients in, summed gradients out (replica context)."""

    @abc.abstractmethod
    def __call__(self, gradients: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
        """Returns the gradients summed over all replicas, in the same order."""

    def check_optimizer(self, optimizer) -> None:
        """Raises when `optimizer` cannot apply what this aggregator returns; default: any."""

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Creates any state (under `strategy.scope()`); default: none."""

    def optimizer_for(self, optimizer):
        """The Keras optimizer that applies this aggregator's output; default: `optimizer`."""
        return optimizer

    def boundaries(self) -> tuple[int, ...]:
        """Steps where `phase` changes (e.g. the end of a warm-up); default: none."""
        return ()

    def phase(self, step: int) -> Hashable | None:
        """The phase of `step`; each distinct phase is traced once. Default: one phase."""
        return None

    def set_phase(self, phase: Hashable | None) -> None:
        """Told the phase of the step being traced, before `__call__`; default: ignored."""
        del phase  # a body AutoGraph can convert (a docstring alone makes it warn)

    def checkpoint_items(self) -> dict:
        """Trackables to checkpoint with the model, by name; default: none."""
        return {}

    def state_variables(self) -> tuple[tf.Variable, ...]:
        """Per-replica variables a step changes and a skipped step must not (assigned in the
        replica context); default: none."""
        return ()


class AllReduce(GradientAggregator):
    """One batched SUM all-reduce of every gradient: what tf.distribute itself does, except
    that a sparse gradient with as many rows as its variable is sent dense (smaller)."""

    def __call__(self, gradients, variables):
        context = tf.distribute.get_replica_context()
        if context is None or not communicates(context):
            return list(gradients)
        gradients = [densify_if_smaller(g, v) for g, v in zip(gradients, variables)]
        return context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)


class NoReduce(GradientAggregator):
    """No collective: each worker applies its own gradients (parameter-server training)."""

    def __call__(self, gradients, variables):
        return list(gradients)


def densify_if_smaller(gradient, variable):
    """A sparse (IndexedSlices) gradient with at least as many rows as its variable goes
    dense: fewer bytes than all-gathering its rows and indices, and a size known before the
    step runs. An embedding looked up by a whole batch of tokens is the usual case."""
    if isinstance(gradient, tf.IndexedSlices):
        rows = gradient.values.shape[0]
        if rows is None or rows < variable.shape[0]:
            return gradient
    return tf.ensure_shape(tf.convert_to_tensor(gradient), variable.shape)  # a static size

