"""DGC on Adam: Deep Gradient Compression's top-k on 1-bit Adam's frozen variance.

DGC (tfpar.compression.dgc) sparsifies momentum SGD; these transformers train with Adam,
and momentum SGD alone ends 20% above AdamW at 600 steps. 1-bit Adam (Tang et al., 2021)
shows the way across: after an Adam warm-up the variance v is frozen, so Adam's step is a
fixed diagonal scaling of the gradients, which is all DGC needs. After `freeze_step` each
replica r keeps

    u_r <- mu u_r + (1 - mu) R g_r                   velocity (R g_r: this replica's estimate
                                                     of the sum; mu = `momentum`, 0 by default)
    a_r <- a_r + c_t u_r / (sqrt(v) + eps)           accumulated, in units of Adam's step
    send the k = ratio * n largest |a_r|             one top-k over every compressed entry
    a_r[sent] <- 0 (and u_r[sent] <- 0 if mu > 0)     error feedback (+ momentum-factor masking)

and the optimizer applies the mean of what was sent (c_t: Adam's bias factors, the
variance's frozen at `freeze_step`; the momentum's only with a velocity). Clipping is the
global norm of the mean gradient over every tensor, R g_r estimating the compressed part
(tfpar.compression.clipping). As in 1-bit Adam, train with the Adam or AdamW you mean: its
betas, epsilon and global_clipnorm move in here and an SGD applies the step. The top-k runs in units of Adam's step, not of the gradient: an entry with a small
variance moves the weight more per unit of gradient, and is picked by how far it would move it.

`momentum=0` is the default because it measured best (gpt_tiny, 600 steps, 50x;
benchmarks/results/compression/README.md, compression/tiny_600_dgc_adam.json): the accumulation a_r already smooths what a velocity would, and every
gradient keeps its whole weight until it is sent. With DGC's momentum correction
(`momentum=0.9` with masking) an entry sent every step keeps only (1 - mu) of each gradient,
so the entries that matter most move the least. With `momentum=beta_1` and `ratio=1` every
step is exactly Adam with the variance frozen (tested); the velocities start from the
warm-up's agreed momentum. Tensors the policy leaves out keep full Adam on a float32
all-reduce, as in 1-bit Adam; so does the warm-up (`warmup_compressor`: fp16 or bf16).

Example:
    >>> trainer = Trainer(model, keras.optimizers.AdamW(schedule, global_clipnorm=1.0), loss,
    ...                   strategy=strategy, compression=DGCAdam(ratio=0.01, freeze_step=120))
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from tfpar.compression import gather
from tfpar.compression.compressed_aggregator import SIZE_EXCHANGE_BYTES
from tfpar.compression.replica_state import MEAN, SAME, per_replica
from tfpar.compression.compressors import CompressionError
from tfpar.compression.dgc import DGC, decode_sum, top_k_words
from tfpar.compression.onebit_adam import OneBitAdam
from tfpar.compression.policy import Policy


class DGCAdam(OneBitAdam):
    """Adam with DGC's top-k after `freeze_step` (see module docstring). On the wire: k int32
    indices + k float32 values per replica, all-gathered (8 k bytes: 1 / (2 ratio) x fewer)."""

    kind = "dgc_adam"

    def __init__(self, ratio: float = 0.01, freeze_step: int = 100, momentum: float = 0.0,
                 masking: bool = True, beta_1: float | None = None, beta_2: float | None = None,
                 epsilon: float | None = None, clip_norm: float | None = None, policy: Policy | None = None,
                 warmup_compressor: str = "none"):
        if not 0 < ratio <= 1:
            raise CompressionError(f"dgc_adam ratio must be in (0, 1] (the fraction of entries sent), "
                                   f"got {ratio}.")
        if not 0 <= momentum < 1:
            raise CompressionError(f"dgc_adam momentum must be in [0, 1) (0: no local velocity), got {momentum}.")
        super().__init__(freeze_step=freeze_step, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                         clip_norm=clip_norm, policy=policy, warmup_compressor=warmup_compressor)
        self.ratio, self.momentum, self.masking = ratio, momentum, masking

    def __repr__(self):
        start = f", {self.warmup_compressor!r} start" if self.warmup_compressor else ""
        velocity = f", momentum={self.momentum:g}" if self.momentum else ""
        return f"dgc_adam({self.ratio:g}, freeze={self.freeze_step}{velocity}{start})"

    def _build_state(self, variables: Sequence[tf.Variable]) -> None:
        self.size = self._build_moments(variables)
        self.k = DGC.k(self.size, self.ratio) if self.size else 0
        # each replica's accumulation and velocity estimate the whole (R g): the model gets
        # their mean, which another replica count keeps
        self.accumulated = per_replica(tf.zeros([self.size]), "accumulated", MEAN)
        if self.momentum:
            self.velocity = per_replica(tf.zeros([self.size]), "velocity", MEAN)
            # 1 once a compressed step has run (the optimizer's step can lag trainer.step: skipped steps)
            self.velocity_started = per_replica(tf.constant(0.0), "velocity_started", SAME)

    @property
    def padded(self) -> int:
        """Nothing to pad: one top-k over the concatenation of `size` entries."""
        return self.size

    def payload_bytes(self, variables: Sequence[tf.Variable], phase: str = "compressed") -> dict:
        """Analytic bytes one replica hands to collectives per step, by collective."""
        report = {"all_reduce": self._all_reduced_bytes(variables, phase)}
        if phase != "warmup" and self.size and self.k >= self.size:  # ratio 1: all of it, reduced
            report["all_reduce"] += 4 * self.size
        elif phase != "warmup" and self.size:
            report.update({"all_gather": 8 * self.k, "(size exchange)": SIZE_EXCHANGE_BYTES})
        return report

    def _compressed_step(self, context, index, local, replicas, communicate, t, result) -> None:
        """`local`: this replica's R g of the compressed tensors `index`, clipped."""
        velocity = self._concat_flat(local)
        if self.momentum:  # the first compressed step starts from the warm-up's agreed momentum
            # (t: a checkpoint from before the flag restores it as 0 past the first step)
            first = (1.0 - self.velocity_started) * tf.cast(t <= self.freeze_step + 1.0, tf.float32)
            previous = first * self._concat_flat([self.m[i] for i in index]) + (1.0 - first) * self.velocity
            self.velocity_started.assign(1.0)
            velocity = self.momentum * previous + (1 - self.momentum) * velocity
        factor = math.sqrt(1 - self.beta_2 ** self.freeze_step)  # the variance's, frozen
        if self.momentum:  # the velocity carries Adam's momentum, and its bias
            factor = factor / (1 - tf.pow(self.beta_1, t))
        variance = self._concat_flat([self.v[i] for i in index])
        accumulated = self.accumulated + factor * velocity / (tf.sqrt(variance) + self.epsilon)
        mean, picked = self._sparse_mean(context, accumulated, replicas, communicate)
        zeros = tf.zeros([self.k])
        self.accumulated.assign(tf.tensor_scatter_nd_update(accumulated, picked[:, None], zeros))
        if self.momentum:  # at ratio 1 nothing is masked: Adam with the variance frozen
            masked = self.masking and self.k < self.size
            self.velocity.assign(tf.tensor_scatter_nd_update(velocity, picked[:, None], zeros)
                                 if masked else velocity)
        for i, part in zip(index, self._split_flat(mean, index)):
            result[i] = part

    def _sparse_mean(self, context, accumulated, replicas, communicate) -> tuple[tf.Tensor, tf.Tensor]:
        """(the mean over replicas of each one's k largest |accumulated| entries, dense
        [size]; this replica's picked indices [k])."""
        if self.k >= self.size:  # ratio 1: every entry, all-reduced
            mean = context.all_reduce(tf.distribute.ReduceOp.MEAN, accumulated) if communicate else accumulated
            return mean, tf.range(self.size)
        picked, words = top_k_words(accumulated, self.k)
        everyone = gather.all_gather_words(context, words[None]) if communicate else words[None]  # [R, 2k]
        return decode_sum(everyone, self.size, self.k) / replicas, picked
