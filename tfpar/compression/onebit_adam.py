"""1-bit Adam (Tang et al., 2021; DeepSpeed): Adam warm-up, then frozen variance and
1-bit compressed momentum, error-compensated on the sending and the receiving side.

An aggregator that owns Adam's moments and returns Adam's step direction. Train with the
Adam or AdamW you mean: its betas, epsilon and `global_clipnorm` move into the compressor,
and a plain SGD with its learning rate, schedule, weight decay and EMA applies the step
(AdamW's decoupled decay and SGD's are the same update; tfpar.compression.adopted). A plain
SGD (momentum 0, no clipping) is taken as it is, with the compressor's own betas.

- warm-up (`freeze_step` steps): gradients summed by one all-reduce (in float32, or every
  tensor in 16 bits with `warmup_compressor="fp16"`/"bf16": half the bytes; clipped by their
  global norm if `clip_norm`), then exactly Keras Adam: the direction is
  sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), so SGD(lr) moves the weights as Adam(lr);
- compressed: v (and its bias factor) frozen; each replica updates its own momentum from its
  local gradient (times R: an estimate of the sum), the momenta are averaged by the
  two-phase 1-bit all-reduce (tfpar.compression.two_phase) and every replica continues from
  that average. Tensors the policy leaves out (biases, norms, small ones) keep full Adam
  on a float32 all-reduce. Clipping stays the global norm of the mean gradient over every
  tensor (tfpar.compression.clipping: the compressed tensors' part estimated from each
  replica's R g, one float on the dense all-reduce). Entries whose frozen variance is
  below epsilon^2 (unused embedding rows, dead units, padding) keep a zero momentum: 1 bit
  cannot send 0, and such an entry would move scale / epsilon every step (DeepSpeed's
  `exp_avg_mask`, found here from v itself);
- `exchange_every=K` (K > 1) sends the 1-bit momentum on every K-th compressed step only,
  K times fewer bytes. In between every replica steps with the last agreed momentum m as
  its prediction of the step's momentum (the weights stay identical on every replica), and
  keeps what that missed, (1 - beta_1)(R g - m) for its local gradient g, in a pending
  sum. The next exchange sends beta_1 m + (1 - beta_1) R g + pending, so the agreed
  momentum goes m -> (1 - K(1 - beta_1)) m + (1 - beta_1) x the window's gradients, and each
  m is stepped with K times. Every gradient keeps its whole weight in the trajectory (at a
  constant learning rate, before compression error), at most K - 1 steps late; where the
  gradient is what the momentum predicts, nothing is late. That needs K (1 - beta_1) <= 1
  (K <= 10 at beta_1 = 0.9): past it the momentum flips sign every window, and from
  2 / (1 - beta_1) it grows without bound, so larger K are refused. What 0/1 Adam (Lu et
  al., 2023) gets from local steps, without letting the weights drift.

Example:
    >>> optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01, beta_2=0.98, global_clipnorm=1.0)
    >>> trainer = Trainer(model, optimizer, loss, strategy=strategy,
    ...                   compression=OneBitAdam(freeze_step=100))
    >>> OneBitAdam(freeze_step=100, exchange_every=2)   # 1 bit every other step
"""

from __future__ import annotations

import math
import sys
from typing import Sequence

import tensorflow as tf

import keras

from tfpar.compression import accounting, adopted, clipping, collectives, two_phase
from tfpar.compression.compressed_aggregator import Compression, _check_dtype_support, _dense
from tfpar.compression.replica_state import SAME, THIS_COUNT, per_replica
from tfpar.compression.compressors import CompressionError, Sign
from tfpar.compression.policy import Policy, start_compressor
from tfpar.aggregation import communicates
from tfpar.strategy import private_api

DEFAULTS = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "clip_norm": 0.0}  # Keras Adam's


def max_exchange_every(beta_1: float = 0.9) -> int:
    """The largest `exchange_every` whose held momentum stays stable: 1 / (1 - beta_1)."""
    return int(1 / (1 - beta_1) + 1e-9)


class OneBitAdam(Compression):
    """Adam with 1-bit compressed momentum after `freeze_step` (see module docstring)."""

    kind = "onebit_adam"  # its name in configs and messages

    def __init__(self, freeze_step: int = 100, beta_1: float | None = None, beta_2: float | None = None,
                 epsilon: float | None = None, clip_norm: float | None = None, policy: Policy | None = None,
                 warmup_compressor: str = "none", exchange_every: int = 1):
        tf.Module.__init__(self, name=self.kind)  # a Compression by kind (Trainer's
        # compression= takes it), with its own state and step
        if freeze_step < 1:
            raise CompressionError(f"{self.kind} freeze_step must be >= 1 (Adam warm-up steps before "
                                   f"the variance is frozen), got {freeze_step}.")
        if exchange_every < 1:
            raise CompressionError(f"onebit_adam exchange_every must be >= 1 (send the compressed "
                                   f"momentum every K-th step; 1: every step), got {exchange_every}.")
        self.freeze_step, self.exchange_every = freeze_step, exchange_every
        self._given = {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon, "clip_norm": clip_norm}
        self._set_hyperparameters(self._given)
        self.warmup_compressor = start_compressor(warmup_compressor, f"{self.kind} warmup_compressor")
        self.policy = policy or Policy()
        self.compressed: list[bool] = []
        self.compressor, self.reset_on_restore, self.state = Sign(), False, {}
        self._phase = None

    def __repr__(self):
        start = f", {self.warmup_compressor!r} start" if self.warmup_compressor else ""
        every = f", every {self.exchange_every} steps" if self.exchange_every > 1 else ""
        return f"onebit_adam(freeze={self.freeze_step}{start}{every})"

    def _set_hyperparameters(self, values: dict) -> None:
        """Betas, epsilon and clip_norm: `values` where given (not None), else Keras Adam's."""
        chosen = {k: DEFAULTS[k] if values.get(k) is None else float(values[k]) for k in DEFAULTS}
        beta_1, beta_2, epsilon, clip_norm = (chosen[k] for k in DEFAULTS)
        if not (0 <= beta_1 < 1 and 0 <= beta_2 < 1) or epsilon <= 0 or clip_norm < 0:
            raise CompressionError(f"{self.kind} needs betas in [0, 1), epsilon > 0, clip_norm >= 0.")
        if self.exchange_every > max_exchange_every(beta_1):
            raise CompressionError(
                f"onebit_adam exchange_every={self.exchange_every} is more than 1 / (1 - beta_1) = "
                f"{1 / (1 - beta_1):.4g}: the held momentum would flip sign every exchange (and grow "
                f"without bound from {2 / (1 - beta_1):.4g}). Use exchange_every <= {max_exchange_every(beta_1)}.")
        self.beta_1, self.beta_2, self.epsilon, self.clip_norm = beta_1, beta_2, epsilon, clip_norm

    # -- contract --------------------------------------------------------------------------

    def _build_state(self, variables: Sequence[tf.Variable]) -> None:
        size = self._build_moments(variables)
        self.padded = two_phase.padded_size(size, self.replicas) if size else 0
        # The error buffers are padded for R replicas, so they are checkpointed under a name
        # with R in it: under another replica count they start at zero (DeepSpeed resets them
        # on every load) instead of failing on their shapes; m, v and the step restore.
        # Under the same count each replica gets its own buffers back.
        errors = tf.Module(name="errors")
        errors.worker = per_replica(tf.zeros([self.padded]), "worker_error", THIS_COUNT)
        errors.server = per_replica(tf.zeros([self.padded // self.replicas]), "server_error", THIS_COUNT)
        if self.exchange_every > 1:  # what the agreed momentum missed since the last exchange
            errors.pending = per_replica(tf.zeros([self.padded]), "pending", THIS_COUNT)
        self._errors_name = f"errors_for_{self.replicas}_replicas"
        setattr(self, self._errors_name, errors)
        self.error_replicas = per_replica(tf.constant(float(self.replicas)), "error_replicas", SAME)

    def _build_moments(self, variables: Sequence[tf.Variable]) -> int:
        """Adam's m, v and step for every variable, and which ones the policy compresses;
        returns how many entries those have."""
        strategy = tf.distribute.get_strategy()
        if self.warmup_compressor is not None:
            _check_dtype_support(self.warmup_compressor, strategy)  # bf16: not on GPUs
        self.replicas = strategy.num_replicas_in_sync
        paths = [getattr(v, "path", v.name) for v in variables]
        self.compressed = [self.policy.choose(p, tuple(v.shape), Sign()) is not None
                           for p, v in zip(paths, variables)]
        self.m = [per_replica(tf.zeros(v.shape), "m", SAME) for v in variables]  # agreed: the same everywhere
        self.v = [per_replica(tf.zeros(v.shape), "v", SAME) for v in variables]
        self.iterations = per_replica(tf.constant(0.0), "iterations", SAME)
        return sum(int(v.shape.num_elements()) for v, c in zip(variables, self.compressed) if c)

    @property
    def worker_error(self) -> tf.Variable:
        """The sending side's error (this replica's), [padded]."""
        return getattr(self, self._errors_name).worker

    @property
    def server_error(self) -> tf.Variable:
        """The receiving side's error for this replica's chunk, [padded / R]."""
        return getattr(self, self._errors_name).server

    @property
    def pending(self) -> tf.Variable:
        """What the agreed momentum missed since the last exchange, (1 - beta_1)(R g - m)
        summed over the held steps, this replica's, [padded] (with exchange_every > 1)."""
        return getattr(self, self._errors_name).pending

    def boundaries(self) -> tuple[int, ...]:
        return (self.freeze_step,)

    def phase(self, step: int) -> str:
        return "warmup" if step < self.freeze_step else "compressed"

    def set_phase(self, phase) -> None:
        self._phase = phase

    def checkpoint_items(self) -> dict:
        return {"compression": self}

    def check_optimizer(self, optimizer) -> None:
        """Takes Adam's or AdamW's betas, epsilon and global_clipnorm (see module docstring);
        a plain SGD is taken as it is. Anything else is refused, by name."""
        inner = private_api.base_optimizer(optimizer)
        self._adopted = None
        if adopted.is_plain_sgd(inner):
            adopted.refuse_options_of(optimizer, self.kind, f"{type(self).__name__}(clip_norm=...)")
            return
        if not isinstance(inner, keras.optimizers.Adam) or inner.amsgrad:
            raise CompressionError(
                f"{self.kind} computes Adam's step with compressed momentum: train with "
                f"keras.optimizers.Adam or AdamW (amsgrad off), not {type(inner).__name__}"
                f"{' with amsgrad' if getattr(inner, 'amsgrad', False) else ''}; its learning rate, "
                "schedule, betas, epsilon, weight decay and global_clipnorm apply (config: "
                "--config.optimizer.name=adamw).")
        adopted.refuse_options_of(optimizer, self.kind, "global_clipnorm")
        found = {"beta_1": inner.beta_1, "beta_2": inner.beta_2, "epsilon": inner.epsilon,
                 "clip_norm": inner.global_clipnorm}
        self._set_hyperparameters({k: adopted.agree(self.kind, k, self._given[k], found[k], DEFAULTS[k])
                                   for k in DEFAULTS})
        self._adopted = inner

    def optimizer_for(self, optimizer):
        """A plain SGD with the Adam's learning rate, weight decay and EMA (or the plain SGD
        given)."""
        if getattr(self, "_adopted", None) is None:
            return optimizer
        return adopted.plain_sgd_for(optimizer)

    # -- bytes -----------------------------------------------------------------------------

    def describe(self, variables):
        sent = self.payload_bytes(variables)
        return [("(all)", repr(self), 4 * sum(int(v.shape.num_elements()) for v in variables),
                 sum(sent.values()))]

    def payload_bytes(self, variables: Sequence[tf.Variable], phase: str = "compressed") -> dict:
        """Analytic bytes one replica hands to collectives per step, by collective."""
        report = {"all_reduce": self._all_reduced_bytes(variables, phase)}
        if phase != "warmup" and self.padded:  # the mean per step: one exchange in K steps
            every = self.exchange_every
            report.update({kind: b / every if every > 1 else b
                           for kind, b in two_phase.payload_bytes(self.padded, self.replicas).items()})
        return report

    def _all_reduced_bytes(self, variables: Sequence[tf.Variable], phase: str) -> int:
        """Bytes of the dense all-reduce: every tensor in the warm-up (in float32 or its start
        compressor), those the policy leaves out after it."""
        start = self.warmup_compressor if phase == "warmup" else None
        norm = clipping.NORM_BYTES if self.clip_norm and phase != "warmup" and any(self.compressed) else 0
        return norm + sum(start.payload_bytes(int(v.shape.num_elements())) if start else 4 * int(v.shape.num_elements())
                          for v, c in zip(variables, self.compressed) if phase == "warmup" or not c)

    # -- the step (replica context) --------------------------------------------------------

    def __call__(self, gradients, variables):
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        communicate = communicates(context)
        grads = [_dense(g, v) for g, v in zip(gradients, variables)]
        t = self.iterations + 1.0
        self.iterations.assign(t)
        warm = self._phase == "warmup"
        dense = [i for i, c in enumerate(self.compressed) if warm or not c]
        index = [] if warm else [i for i, c in enumerate(self.compressed) if c]

        def all_reduce(tensors):
            if not tensors or not communicate:
                return list(tensors)
            start = self.warmup_compressor if warm else None
            sent = [start.encode(g, replicas) for g in tensors] if start else tensors
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
            return [start.decode(g, replicas) for g in summed] if start else summed

        # the mean gradient where it is known, each replica's estimate R g where it is not,
        # clipped by one factor (tfpar.compression.clipping)
        summed, local = clipping.reduce_and_clip(
            self.clip_norm, [grads[i] for i in dense], [grads[i] * replicas for i in index],
            replicas, all_reduce)
        result: list = [None] * len(grads)
        b1 = 1 - tf.pow(self.beta_1, t)
        for i, g in zip(dense, summed):
            m = self.m[i] + (g - self.m[i]) * (1 - self.beta_1)
            v = self.v[i] + (tf.square(g) - self.v[i]) * (1 - self.beta_2)
            self.m[i].assign(m)
            self.v[i].assign(v)
            result[i] = tf.sqrt(1 - tf.pow(self.beta_2, t)) / b1 * m / (tf.sqrt(v) + self.epsilon)
        if index and self.padded:
            self._compressed_step(context, index, local, replicas, communicate, t, result)
        return result

    def _exchange_every_k(self, t, agreed, added, exchange) -> tf.Tensor:
        """The momentum every replica steps with: the exchanged one every K-th compressed step,
        else the last agreed one (what it missed waits in `pending`). The conditional's name
        tells tfpar.compression.accounting to count its mean bytes."""
        pending = self.pending

        def send():
            local_momentum = self.beta_1 * agreed + added + pending
            pending.assign(tf.zeros_like(pending))
            return exchange(local_momentum)

        def hold():
            pending.assign(pending + added - (1 - self.beta_1) * agreed)
            return agreed

        due = tf.equal(tf.math.floormod(t - self.freeze_step, float(self.exchange_every)), 0.0)
        return tf.cond(due, send, hold, name=accounting.every_k_steps_name(self.exchange_every))

    def _say_if_errors_were_reset(self, replicas: int) -> None:
        """After a restore from another replica count (its count is checkpointed), replica 0
        says once that the error buffers started at zero."""
        def say():
            tf.print("tfpar: onebit_adam's error buffers (and gradients pending an exchange) were "
                     "checkpointed with", tf.cast(self.error_replicas, tf.int32), "replicas; this run has",
                     replicas, "so they start at zero (momentum, variance and step were restored).",
                     output_stream=sys.stderr)
            return tf.constant(0)
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        stale = tf.not_equal(self.error_replicas, float(replicas))
        tf.cond(tf.logical_and(first, stale), say, lambda: tf.constant(0))
        self.error_replicas.assign(float(replicas))

    def _concat_flat(self, parts) -> tf.Tensor:
        """The compressed tensors as one vector of `padded` entries (zeros at the end)."""
        flat = tf.concat([tf.reshape(p, [-1]) for p in parts], 0)
        return tf.pad(flat, [[0, self.padded - int(flat.shape[0])]])

    def _split_flat(self, flat: tf.Tensor, index: list[int]) -> list[tf.Tensor]:
        """`_concat_flat`'s inverse: one tensor per compressed variable, shaped like its moments."""
        sizes = [int(self.m[i].shape.num_elements()) for i in index]
        return [tf.reshape(part, self.m[i].shape) for i, part in zip(index, tf.split(flat[:sum(sizes)], sizes))]

    def _frozen_variance_mask(self, i: int) -> tf.Tensor:
        """1 where the frozen variance can carry a 1-bit momentum (v > epsilon^2), else 0."""
        return tf.cast(self.v[i] > self.epsilon ** 2, tf.float32)

    def _compressed_step(self, context, index, local, replicas, communicate, t, result) -> None:
        """`local`: this replica's R g of the compressed tensors `index`, clipped."""
        self._say_if_errors_were_reset(replicas)
        agreed = self._concat_flat([self.m[i] for i in index])             # the same on every replica
        added = self._concat_flat([(1 - self.beta_1) * g for g in local])  # this replica's gradient

        def exchange(local_momentum):
            return two_phase.compressed_mean(context, local_momentum, self.worker_error, self.server_error,
                                             replicas, communicate, lambda w: collectives.all_gather_words(context, w))

        if self.exchange_every == 1:
            mean = exchange(self.beta_1 * agreed + added)
        else:
            mean = self._exchange_every_k(t, agreed, added, exchange)
        frozen = math.sqrt(1 - self.beta_2 ** self.freeze_step) / (1 - tf.pow(self.beta_1, t))
        for i, m in zip(index, self._split_flat(mean, index)):
            m = m * self._frozen_variance_mask(i)
            self.m[i].assign(m)
            result[i] = frozen * m / (tf.sqrt(self.v[i]) + self.epsilon)
