"""Preemption: SIGTERM to any worker, and every worker saves at the same step, then exits.

A preempted VM gets SIGTERM and a short grace period. `PreemptionWatch` records the
signal; after every training call (each `steps_per_loop` steps) all workers add up their
flags with one tiny all-reduce, so they agree on the step to stop at, save one checkpoint
there together, and exit with EXIT_PREEMPTED (75, "temporary failure: try again").
`tfpar-launch --max-restarts K` then starts the group again and tfpar-train resumes at
exactly that step, its data position included.

TensorFlow's own PreemptionCheckpointHandler does the same for multi_worker_mirrored and
TPUs, but numbers its checkpoints by its own counter and saves inside its call; this watch
works under every synchronous strategy (one device, mirrored, multi-worker, TPU) with the
binary's own checkpoints. Parameter-server clusters do not need it: a worker that dies is
restarted while the chief goes on, and the chief checkpoints every checkpoint_every steps.

Example:
    >>> watch = PreemptionWatch(strategy)           # installs the SIGTERM handler
    >>> Controller(..., checkpoints=checkpoints, preemption=watch)   # saves, raises Preempted
"""

from __future__ import annotations

import signal

import tensorflow as tf

EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits with EXIT_PREEMPTED."""

    def __init__(self, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM (or `signals`) and tells, the same on every worker, when to stop."""

    def __init__(self, strategy: tf.distribute.Strategy, signals=(signal.SIGTERM,)):
        self.strategy, self.signalled = strategy, False
        for sig in signals:
            signal.signal(sig, self._note)
        self._any = tf.function(self._any_replica)

    def _note(self, signum, _frame) -> None:
        self.signalled = True

    def _any_replica(self, flag):
        with tf.name_scope("tfpar_preemption"):  # named apart from the step's collectives (profiles)
            per_replica = self.strategy.run(lambda: tf.identity(flag))
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def agreed(self) -> bool:
        """True when any worker was signalled: one small all-reduce, so every worker must
        call it at the same point (tfpar.controller.Controller does, after every run of steps)."""
        if self.strategy.num_replicas_in_sync == 1:  # one process, one replica
            return self.signalled
        return float(self._any(tf.constant(float(self.signalled)))) > 0
