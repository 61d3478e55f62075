"""The errors tfpar raises. Each message says what is wrong and names the fix.

Every class derives from `TfparError`, so callers can catch all of tfpar's own
refusals in one place, and from the builtin that fits (`ValueError` for bad input,
`RuntimeError` for a wrong moment or missing hardware), so generic handlers work too.

Example:
    >>> try:
    ...     tfpar.create_strategy("mirored")
    ... except tfpar.TfparError as e:
    ...     print(e)   # Unknown strategy 'mirored'. Did you mean 'mirrored'? ...
"""


class TfparError(Exception):
    """Base class of every error tfpar raises on purpose."""


class UnknownStrategyError(TfparError, ValueError):
    """A strategy name that tfpar does not know."""


class StrategyOptionError(TfparError, ValueError):
    """An option that does not fit the chosen strategy (e.g. all_reduce='nccl' on CPU)."""


class ClusterConfigError(TfparError, ValueError):
    """A malformed or inconsistent cluster description (TF_CONFIG, SLURM, dict)."""


class PeerUnreachableError(TfparError, ConnectionError):
    """A task of the cluster did not answer before the deadline."""


class RuntimeAlreadyStartedError(TfparError, RuntimeError):
    """Something that must be configured before TensorFlow starts came too late."""


class TPUNotFoundError(TfparError, RuntimeError):
    """A TPU was asked for and none was found."""


class TPUSliceError(TPUNotFoundError):
    """A TPU is there, but not usable the way it was asked for (a multi-host slice)."""


class KerasBackendError(TfparError, ImportError):
    """Keras is set to a backend other than TensorFlow; tfpar runs on tf.distribute."""


class UnsupportedStrategyError(TfparError, RuntimeError):
    """A feature that cannot run under the active strategy (e.g. Keras fit under PS)."""


class DataError(TfparError, ValueError):
    """A dataset that cannot feed the run (unknown name, too small, batch does not divide)."""


class NonFiniteError(TfparError, FloatingPointError):
    """The loss or the gradients became NaN or Inf; the message names the step."""

    @classmethod
    def at(cls, step: str, what: str, clip: str, alternative: str) -> "NonFiniteError":
        """The one message for a non-finite step, from the loop or from Keras fit."""
        return cls(f"Step {step}: {what}; training stopped before anything was saved, so the "
                   "last checkpoint is the last good state. Lower the learning rate, clip "
                   f"gradients ({clip}), check the data, or {alternative}.")


class CheckpointMismatchError(TfparError, ValueError):
    """A checkpoint that was written by another model (or another config of it)."""


class CheckpointDamagedError(TfparError, RuntimeError):
    """Every checkpoint in the workdir is damaged (missing or truncated files, bad checksums)."""


class ConfigError(TfparError, ValueError):
    """A config value that cannot work; the message names the key."""


class ShardingError(TfparError, ValueError):
    """A sharded update (ZeRO: Trainer(shard=...)) that cannot work with this optimizer,
    variable, strategy or option; the message names the fix."""


class WorkdirError(TfparError, OSError):
    """The workdir cannot take what the run writes (read-only, full)."""


class SyncError(TfparError, ValueError):
    """A DiLoCo setting, combination or state that cannot run; the message names the fix."""
