"""The Trainer's options, resolved and checked before anything is built.

Example:
    >>> aggregator = aggregator_for(strategy, aggregator=None, compression=TopK(0.01))
    >>> check_placement(model, strategy, placement)       # raises TrainerError, by name
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.compression.compressed_aggregator import Compression
from tfpar.compression.compressors import Compressor
from tfpar.errors import TfparError
from tfpar.loop import parameter_server
from tfpar.aggregation import AllReduce, GradientAggregator, NoReduce
from tfpar.loop.nonfinite import SkippedStepState
from tfpar.placement import tpu_cores
from tfpar.placement.plan import PlacementError, is_multi_worker_mirrored


class TrainerError(TfparError, ValueError):
    """A Trainer option that cannot work with this model, optimizer or strategy."""


def unpack(batch):
    if isinstance(batch, (tuple, list)):
        if len(batch) == 3:
            return batch
        if len(batch) == 2:
            return batch[0], batch[1], None
    raise TrainerError("Batches must be (x, y) or (x, y, sample_weight).")


def aggregator_for(strategy, aggregator: GradientAggregator | None,
                    compression: Compressor | Compression | None, model=None) -> GradientAggregator:
    """The aggregator the options ask for (compression is shorthand for one); a
    tensor-parallel model's own (tfpar.loop.tensor_parallel): its split gradients must not
    be summed across their tensor-parallel group."""
    if model is not None and tensor_parallel_layout(model) is not None:
        return _tensor_parallel_aggregator(model, strategy, aggregator, compression)
    if compression is not None:
        if aggregator is not None:
            raise TrainerError("Give aggregator or compression, not both.")
        aggregator = compression if isinstance(compression, Compression) else Compression(compression)
    if parameter_server.is_parameter_server(strategy):
        if aggregator is not None:
            raise TrainerError(
                "Under parameter_server each worker applies its own gradients on the "
                "parameter servers; there is no all-reduce to replace, so an aggregator "
                "(or gradient compression) does not apply. Use multi_worker_mirrored.")
        return NoReduce()
    return aggregator or AllReduce()


def tensor_parallel_layout(model):
    """The model's tensor-parallel Layout (tfpar.tensor_parallel), None if unsplit."""
    from tfpar import tensor_parallel  # pylint: disable=import-outside-toplevel

    return tensor_parallel.layout_of(model)


def _tensor_parallel_aggregator(model, strategy, aggregator, compression) -> GradientAggregator:
    from tfpar.loop.tensor_parallel import TensorParallelSum  # pylint: disable=import-outside-toplevel

    layout = tensor_parallel_layout(model)
    if aggregator is not None or compression is not None:
        raise TrainerError(
            f"A {layout.degree}-way tensor-parallel model sums its gradients over data-parallel "
            "groups only (tfpar.loop.tensor_parallel): an aggregator or a compression would sum "
            "its split gradients across their tensor-parallel group. Leave both out.")
    if strategy is not layout.strategy:
        raise TrainerError("Train a tensor-parallel model under the strategy it was built under "
                           "(Trainer(strategy=strategy) with the strategy whose scope built it).")
    return TensorParallelSum(layout)


def skipped_step_state(state, skips: bool, nonfinite: str) -> SkippedStepState | None:
    """With a stateful aggregator every replica agrees whether all gradients are finite: a
    compressed sum can be finite with NaN left in one replica's state. Under skip (or fp16)
    the state is also put back; under stop only the step is named (the run ends there)."""
    if not state or (nonfinite == "ignore" and not skips):
        return None
    return SkippedStepState(state if skips else ())



def check_placement(model, strategy, placement) -> None:
    """Refuses, by name and before a coordinator starts, a placement this model or strategy
    cannot train: non-trainable state, a TPU plan outside TPUStrategy, parameter_server, a
    replica count that differs from the strategy's."""
    replicas = placement.plan.replicas
    if tensor_parallel_layout(model) is not None:
        raise TrainerError("Layer placement (a pipeline) of a tensor-parallel model is not built: "
                           "train it without placement (tensor parallelism alone), or pipeline "
                           "the unsplit model (tensor_parallel=1).")
    if model.non_trainable_variables:
        raise TrainerError("Layer placement needs a model without non-trainable state "
                           "(e.g. no BatchNormalization).")
    if all(tpu_cores.is_logical(d) for d in placement.plan.devices):
        if not isinstance(strategy, tf.distribute.TPUStrategy):
            raise TrainerError("A plan on TPU cores (placement.tpu_cores.logical) trains under "
                               "placement.tpu_cores.tpu_strategy(...), a TPUStrategy.")
        return  # every replica runs the same plan on its own cores
    if parameter_server.is_parameter_server(strategy):
        raise TrainerError("Layer placement does not run under parameter_server; use a plan "
                           "(or a hybrid plan.replicate(...)) under its own plan.strategy, or "
                           "one pipeline per worker under multi_worker_mirrored.")
    if is_multi_worker_mirrored(strategy):  # hybrid across machines
        try:
            placement.plan.check_multi_worker(strategy)
        except PlacementError as error:
            raise TrainerError(str(error)) from None
        return
    if replicas != strategy.num_replicas_in_sync or (
            replicas > 1 and strategy is not placement.plan.strategy):
        raise TrainerError(
            f"This placement has {replicas} pipeline replica(s) but the strategy has "
            f"{strategy.num_replicas_in_sync}: build and train a hybrid plan under its "
            "own strategy (`with plan.scope() as strategy:` ... Trainer(strategy=strategy)), "
            "a single pipeline under the default strategy, or one pipeline per worker under "
            "multi_worker_mirrored (`with plan.scope(strategy):`).")
