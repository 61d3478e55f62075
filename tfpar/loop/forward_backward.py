"""One replica's forward and backward pass in tfpar's loop: the loss as Keras averages it.

The loss of a (micro-)batch is summed over its targets and divided by the targets of the
whole step (every replica's, every micro-batch's), so the replicas' gradients sum to the
gradient of the global batch's mean loss, as Keras fit computes it. The pass is pure
(Keras `stateless_call`: variable values in, loss, gradients and new non-trainable values
out), which is what lets XLA compile it under MirroredStrategy too; with a pipeline the
stage groups run on their devices instead (tfpar.placement.Pipeline).

Example:
    >>> forward_backward = ForwardBackward(model, loss, strategy, accumulate=2, xla=True)
    >>> loss, grads = forward_backward(x, y, w, loss_scale)     # replica context
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.tensor_parallel import styles


class ForwardBackward:
    """`(x, y, w, loss_scale) -> (loss, gradients of loss x loss_scale)` on one replica.

    Args:
      model, loss: the Keras model and a keras.losses.Loss (its `call` gives per-target values).
      strategy: the strategy whose replicas share the global batch.
      accumulate: micro-batches per optimizer step.
      placement: a tfpar.placement.Pipeline (its stage groups on their devices), or None.
      xla: jit-compile the pure pass (never with a placement).
    """

    def __init__(self, model: keras.Model, loss: keras.losses.Loss, strategy, accumulate: int = 1,
                 placement=None, xla: bool = True):
        self.model, self.loss, self.strategy = model, loss, strategy
        self.accumulate, self.placement = accumulate, placement
        # Exact shapes (no reduce_retracing): a static batch keeps every gradient's size
        # static, which XLA wants and which lets the wire bytes be counted before running.
        self.compiled = tf.function(self.stateless, jit_compile=xla and placement is None)

    def values(self, y, y_pred, w) -> tf.Tensor:
        """This (micro-)batch's per-target losses, weighted, in float32."""
        values = self.loss.call(y, y_pred)
        if w is not None:
            values = values * tf.cast(tf.reshape(w, tf.shape(values)), values.dtype)
        return tf.cast(values, tf.float32)

    def denominator(self, local_count) -> tf.Tensor:
        """Loss terms in the global batch of one step (Keras averages over all of them)."""
        return tf.cast(local_count * self.strategy.num_replicas_in_sync * self.accumulate, tf.float32)

    def replica_loss(self, y_pred, y, w, regularization) -> tf.Tensor:
        values = self.values(y, y_pred, w)
        loss = tf.reduce_sum(values) / self.denominator(tf.size(values))
        if regularization:
            loss += tf.add_n([tf.cast(l, tf.float32) for l in regularization]) / (
                self.strategy.num_replicas_in_sync * self.accumulate)
        return loss

    def stateless(self, trainable, non_trainable, loss_scale, x, y, w):
        """Pure: variable values in, (loss, gradients, new non-trainable values) out."""
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, non_trainable, regularization = self.model.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True)
            if styles.marks_in_graph():  # a split model ending column-parallel: `stateless_call`
                y_pred = styles.leaving(self.model, y_pred)  # runs `call`, not `__call__`, which gathers
            loss = self.replica_loss(y_pred, y, w, regularization)
            scaled = loss * loss_scale  # fp16: times the dynamic loss scale
        return loss, tape.gradient(scaled, trainable), non_trainable

    def pipelined(self, x, y, w, loss_scale):
        """Layer placement: the pipeline runs each stage group on its device."""
        count = self.denominator(tf.size(y))

        def share(y_part, logits, w_part):
            return tf.reduce_sum(self.values(y_part, logits, w_part)) / count * loss_scale

        loss, grads = self.placement.forward_backward(x, y, w, share)
        return loss / loss_scale, grads

    def __call__(self, x, y, w, loss_scale):
        """Replica context: reads this replica's variable values, runs the compiled pass."""
        if self.placement is not None:
            return self.pipelined(x, y, w, loss_scale)
        loss, grads, non_trainable = self.compiled(
            [tf.convert_to_tensor(v.value) for v in self.model.trainable_variables],
            [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables],
            loss_scale, x, y, w)
        for variable, value in zip(self.model.non_trainable_variables, non_trainable):
            variable.assign(value)
        return loss, grads
