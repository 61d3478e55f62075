"""Layer placement: stage plans, pipeline schedules (GPipe, 1F1B, interleaved, ZB-H1),
measured timelines and activation memory.

Example:
    >>> plan = tfpar.placement.balanced(GPT.from_preset("tiny"), ["/cpu:0", "/cpu:1"])
    >>> with plan.scope():
    ...     model = GPT.from_preset("tiny")
    >>> trainer = tfpar.Trainer(model, optimizer, loss,
    ...                         placement=tfpar.placement.Pipeline(model, plan, micro_batches=8))
"""

from tfpar.placement import activations, schedules, timeline, tpu_cores
from tfpar.placement.pipeline import SCHEDULES, Pipeline, schedule_order
from tfpar.placement.plan import PlacementError, StageGroup, StagePlan, balanced, manual, stage_params

__all__ = ["PlacementError", "Pipeline", "SCHEDULES", "StageGroup", "StagePlan", "activations", "balanced",
           "manual", "schedule_order", "schedules", "stage_params", "timeline", "tpu_cores"]
