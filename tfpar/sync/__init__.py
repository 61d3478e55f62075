"""How replicas synchronise beyond one all-reduce per step.

- diloco.py: DiLoCo, local inner steps and an outer optimizer on the averaged delta.
- outer_compression.py: how its outer gradients travel (float32, fp16, int8, int4 with
  error feedback).

Example:
    >>> trainer = tfpar.Trainer(model, optimizer, loss, strategy=strategy,
    ...                         sync=tfpar.sync.DiLoCo(inner_steps=25))
"""

from tfpar.sync.diloco import DiLoCo, SyncError, default_outer_optimizer

__all__ = ["DiLoCo", "SyncError", "default_outer_optimizer"]
