"""Where a step's time goes: a profiled window of steps, its breakdown, stragglers.

- `ProfileWindow`: TensorFlow's profiler over chosen steps, every worker into its own
  logdir (TensorBoard's Profile tab), each step marked (tfpar.profiling.window).
- `trace` / `report`: the breakdown read back from that trace: compute, collectives by
  kind, input, idle; the communication log; bus bandwidth; MFU; a picture.
- `StepTimer` / `StragglerWatch`: every worker's own step time, the slowest one named.
- `ProfileSteps`: the window as a Keras callback, for a plain `model.fit`.

Example:
    >>> python -m tfpar.train --config=configs/gpt_tiny.py --workdir=/tmp/run \\
    ...     --config.train.profile_steps=11,14
"""

from tfpar.profiling.keras_callback import ProfileSteps
from tfpar.profiling.stragglers import StepTimer, StragglerWatch
from tfpar.profiling.trace import ProfileError
from tfpar.profiling.window import ProfileWindow, parse_steps

__all__ = ["ProfileError", "ProfileSteps", "ProfileWindow", "StepTimer", "StragglerWatch", "parse_steps"]
