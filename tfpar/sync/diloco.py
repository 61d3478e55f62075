"""DiLoCo (Douillard et al., 2023): local inner steps, then an outer step on the averaged delta.

Every replica trains its own copy of the model for `inner_steps` (H) steps with the user's
own Keras optimizer on its own batches, exchanging nothing. At the end of a round the
replicas average their outer gradient, `anchor - weights` (the anchor: the shared weights
at the start of the round), and an outer optimizer (Nesterov SGD, the paper's learning
rate 0.7 and momentum 0.9, by default) applies it to the anchor; every replica then starts
the next round from the new anchor. One all-reduce of the weights every H steps replaces
one of the gradients every step.

Streaming (Douillard et al., 2025): `fragments=F` splits the weights into F blocks of
consecutive variables (the model's layers in order, balanced by size); fragment f's
rounds end at the steps f * H // F (mod H), so one fragment's exchange, 1/F of the model,
travels every H / F steps instead of the whole model every H, and with `overlap_steps`
it runs beside the steps that follow.

Hierarchical: G consecutive replicas can train as one DiLoCo worker (`replicas_per_worker`;
by default each process's replicas under several worker processes): their gradients are
summed inside the worker every step (one group all-reduce, tfpar.strategy.groups), so they
hold one copy, and DiLoCo runs between the workers.

How it runs on TensorFlow's own runtime: a MirroredVariable holds one copy per replica.
tfpar's loop hands the optimizer each replica's own gradient (no all-reduce), and Keras's
update writes each copy from its own replica's gradient (`strategy.extended.update` with
per-replica arguments), so the copies drift apart during a round, each one its replica's
model; the outer step reads them in a replica context, averages the deltas with the
strategy's all-reduce, updates the anchor in the cross-replica context and writes it to
every copy.

Example:
    >>> sync = DiLoCo(inner_steps=25)      # outer: SGD(0.7, momentum 0.9, nesterov)
    >>> trainer = tfpar.Trainer(model, keras.optimizers.AdamW(1e-3), loss, strategy=strategy, sync=sync)
    >>> trainer.fit(data, steps=600)       # 24 rounds: 24 all-reduces of the weights
    >>> DiLoCo(inner_steps=10, fragments=2, compression="int4", overlap_steps=2)  # streaming
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import keras
import tensorflow as tf

from tfpar.errors import SyncError
from tfpar.strategy import private_api
from tfpar.sync import outer_compression
from tfpar.sync.diloco_checkpoint import OutsideChanges, Tracked, WorkerCopies, keep_copies


def default_outer_optimizer() -> keras.optimizers.Optimizer:
    """The paper's outer optimizer: SGD, learning rate 0.7, Nesterov momentum 0.9."""
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


class DiLoCo:
    """Local steps with an outer optimizer (see the module docstring).

    Args:
      inner_steps: H, the optimizer steps each replica takes on its own between two outer
        steps (>= 1).
      outer_optimizer: a Keras optimizer for the anchor (default: `default_outer_optimizer`);
        its settings are used, in a copy made under the Trainer's strategy and built on the
        anchor's variables (`outer_optimizer` after the Trainer is made).
      replicas_per_worker: G consecutive replicas train as one DiLoCo worker, synchronous
        inside (their gradients summed every step, the hierarchical form). Default: each
        process's replicas under several worker processes, else 1 (every replica a worker).
      compression: how the outer gradients travel: "none" (float32), "fp16", "int8" or
        "int4" (blocks with a scale each; see tfpar.sync.outer_compression). Every code but
        float32 keeps what it did not send and adds it to the next round's (error feedback).
      overlap_steps: tau, 0 <= tau < H. 0: each round's exchange runs between two steps, and
        every step waits for it. tau > 0: the outer gradients of the round ending at step t
        travel during steps t + 1 .. t + tau (their collective runs beside those steps'
        compute in one TensorFlow call), and the outer step applies after step t + tau,
        keeping each replica's progress since t: its weights become the new anchor plus
        what its own tau steps moved them.
      fragments: F, 1 <= F <= H (Streaming DiLoCo): the trainable variables in F blocks of
        consecutive variables of about equal size; fragment f's rounds end at the steps
        congruent to f * H // F modulo H (its first round is shorter), and each round end
        exchanges, codes and applies that fragment only, with its own remainder and its
        own exchange in flight. The outer optimizer's iterations count fragment updates.
    """

    def __init__(self, inner_steps: int, outer_optimizer: keras.optimizers.Optimizer | None = None,
                 replicas_per_worker: int | None = None, compression: str | None = None,
                 overlap_steps: int = 0, fragments: int = 1):
        if int(inner_steps) != inner_steps or inner_steps < 1:
            raise SyncError(f"DiLoCo inner_steps={inner_steps!r}: give the number of local steps "
                            "per round, an integer >= 1 (the paper: 500; over a slow link 10-50).")
        if replicas_per_worker is not None and (int(replicas_per_worker) != replicas_per_worker
                                                or replicas_per_worker < 1):
            raise SyncError(f"DiLoCo replicas_per_worker={replicas_per_worker!r}: give how many "
                            "consecutive replicas train as one DiLoCo worker, an integer >= 1.")
        if int(overlap_steps) != overlap_steps or not 0 <= overlap_steps < inner_steps:
            raise SyncError(f"DiLoCo overlap_steps={overlap_steps!r} with inner_steps={inner_steps}: give "
                            "the steps a round's exchange overlaps, an integer from 0 (none) to inner_steps - 1.")
        if int(fragments) != fragments or not 1 <= fragments <= inner_steps:
            raise SyncError(f"DiLoCo fragments={fragments!r} with inner_steps={inner_steps}: give the blocks "
                            "the model is exchanged in, an integer from 1 to inner_steps (each fragment's "
                            "rounds end on steps of their own).")
        self.inner_steps = int(inner_steps)
        self.overlap_steps = int(overlap_steps)
        self.fragments = int(fragments)
        self.offsets = [f * self.inner_steps // self.fragments for f in range(self.fragments)]
        self.fragment_variables: list[list[int]] = []  # each fragment's indices into the variables
        self._in_flight: list = []  # overlap, per fragment: each replica's delta and send, then the mean
        self._launched: dict = {}  # fragment -> the round end whose exchange this process launched
        self.code = outer_compression.outer_code(compression)
        self.remainders: list = []  # error feedback, per fragment: each replica's own
        self._per_worker_given = replicas_per_worker
        self.replicas_per_worker = 1
        self._worker_groups: list = []
        self._outer_given = outer_optimizer
        self.outer_optimizer: keras.optimizers.Optimizer | None = None
        self.strategy: tf.distribute.Strategy | None = None
        self.anchors: list[tf.Variable] = []
        self._variables: list = []
        self._outer_step = None
        self.worker_copies: WorkerCopies | None = None  # across workers: this worker's copies
        self.outside: OutsideChanges | None = None
        self._trained = False  # a call of the loop has run since build

    def __repr__(self) -> str:
        grouped = f", replicas_per_worker={self._per_worker_given}" if self._per_worker_given else ""
        coded = f", compression={self.code.name!r}" if self.code.name != "none" else ""
        overlapped = f", overlap_steps={self.overlap_steps}" if self.overlap_steps else ""
        streamed = f", fragments={self.fragments}" if self.fragments > 1 else ""
        return f"DiLoCo(inner_steps={self.inner_steps}{grouped}{coded}{overlapped}{streamed})"

    # -- the Trainer's side ----------------------------------------------------------

    def build(self, strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable]) -> None:
        """The anchor (a copy of each trainable variable), the outer optimizer and the
        workers' groups of replicas, under `strategy.scope()`."""
        self.strategy, self._variables = strategy, list(variables)
        self._group_workers(strategy)
        sizes = [int(v.shape.num_elements()) for v in self._variables]
        if self.fragments > len(sizes):
            raise SyncError(f"DiLoCo fragments={self.fragments}: the model has {len(sizes)} trainable "
                            f"variable(s); give at most {len(sizes)}.")
        self.fragment_variables = fragment_blocks(sizes, self.fragments)
        with strategy.scope():
            self.anchors = [keras.Variable(tf.convert_to_tensor(v), trainable=False, name=f"diloco_anchor_{i}")
                            for i, v in enumerate(self._variables)]  # Keras's: the outer optimizer's
            given = self._outer_given  # its settings, in a fresh copy made under the strategy
            self.outer_optimizer = (default_outer_optimizer() if given is None
                                    else type(given).from_config(given.get_config()))
            self.outer_optimizer.build(self.anchors)
            for f, indices in enumerate(self.fragment_variables):
                size, suffix = sum(sizes[i] for i in indices), f"_{f}" if f else ""
                if self.code.error_feedback:  # one flat vector: every weight's remainder
                    self.remainders.append(keras.Variable(tf.zeros([size]), trainable=False,
                                                          name=f"diloco_remainder{suffix}"))
                if self.overlap_steps:  # this replica's delta at the round's end, what it sends, the mean
                    shape, dtype = self.code.sent_spec(size)
                    self._in_flight.append([
                        keras.Variable(tf.zeros([size]), trainable=False, name=f"diloco_delta{suffix}"),
                        keras.Variable(tf.zeros(shape, dtype), trainable=False, dtype=dtype.name,
                                       name=f"diloco_sent{suffix}"),
                        keras.Variable(tf.zeros([size]), trainable=False, name=f"diloco_arrived{suffix}")])
        self._outer_step = tf.function(self._outer_step_fn)
        self._snapshot = tf.function(self._snapshot_fn)
        self._apply = tf.function(self._apply_fn)
        self.outside = OutsideChanges(self._variables, self.anchors, restart=self._restart)

    def keep_replica_copies(self, variables: Sequence) -> None:
        """Checkpoints each replica's own copy of `variables` (the weights and the inner
        optimizer's state differ between replicas during a round; the state differs across
        rounds too). In one process: beside the value every restore reads
        (`VARIABLE_VALUE`, replica 0's, so an unsplit model loads it), `REPLICA_COPIES`
        holds all the copies, restored each into its replica. Across worker processes each
        worker writes its own replicas' copies to its own file (`WorkerCopies`, which
        tfpar.checkpoints.Checkpoints saves and restores per worker)."""
        from tfpar.strategy.replicas import spans_workers  # pylint: disable=import-outside-toplevel

        variables = [*variables, *self.remainders, *self._sent_state()]
        tf_variables = [getattr(v, "value", v) for v in variables]  # Keras's -> TensorFlow's
        if spans_workers(self.strategy):
            self.worker_copies = WorkerCopies(variables, self.strategy)
        else:
            for variable in tf_variables:
                keep_copies(variable)
        for variable in tf_variables:  # around whichever restore the hooks above installed
            private_api.on_restore(variable, self.outside.weights_restored_by_checkpoint)

    def note_weights(self) -> None:
        """Where the Trainer leaves the weights (built, a fit's end): what `check_weights`
        compares with (tfpar.sync.diloco_checkpoint.OutsideChanges)."""
        self.outside.note()

    def check_weights(self) -> None:
        """Where the Trainer takes the weights up again: weights changed outside it without
        the anchor are refused by name; loaded into a Trainer that has not stepped, DiLoCo
        starts from them."""
        self.outside.check(trained=self._trained)

    def _restart(self) -> None:
        """The anchor from the weights (every replica's copy equal; no step taken yet, so
        the outer optimizer, the remainders and the exchanges in flight are as built)."""
        for variable, anchor in zip(self._variables, self.anchors):
            anchor.assign(tf.convert_to_tensor(variable))

    def local_gradients(self, gradients: Sequence, replicas: int) -> list:
        """This DiLoCo worker's gradient of its own batch's mean loss (replica context): the
        loop's gradients are of the global batch's mean (divided by the replicas). A worker
        of one replica takes its own, summed nowhere; a worker of G replicas sums its
        replicas' over its group (one all-reduce inside the worker), so they stay equal."""
        if self.replicas_per_worker == 1:
            return [None if g is None else g * tf.cast(replicas, g.dtype) if not isinstance(g, tf.IndexedSlices)
                    else tf.IndexedSlices(g.values * tf.cast(replicas, g.values.dtype), g.indices, g.dense_shape)
                    for g in gradients]
        from tfpar.strategy import groups  # pylint: disable=import-outside-toplevel

        group = self._worker_groups[groups.here() // self.replicas_per_worker]
        present = [i for i, g in enumerate(gradients) if g is not None]
        scale = replicas / self.replicas_per_worker
        with tf.name_scope("diloco/worker_sum"):
            summed = group.batch_all_reduce([tf.convert_to_tensor(gradients[i]) for i in present])
        found = [None] * len(gradients)
        for i, g in zip(present, summed):
            found[i] = g * tf.cast(scale, g.dtype)
        return found

    def _group_workers(self, strategy) -> None:
        """G, the replicas of one DiLoCo worker: as given, else each process's replicas
        under several worker processes (synchronous inside a process, DiLoCo across), else
        1. A process's replicas must be G consecutive ids (checked)."""
        from tfpar.strategy import groups  # pylint: disable=import-outside-toplevel
        from tfpar.strategy.replicas import spans_workers  # pylint: disable=import-outside-toplevel

        replicas = strategy.num_replicas_in_sync
        local = groups.local_replica_ids(strategy)
        size = self._per_worker_given or (len(local) if spans_workers(strategy) else 1)
        if replicas % size:
            raise SyncError(f"DiLoCo replicas_per_worker={size} does not divide the {replicas} replicas: "
                            "give a divisor.")
        if size > 1 and spans_workers(strategy) and any(r // size != local[0] // size for r in local):
            raise SyncError(f"DiLoCo groups {size} consecutive replicas as one worker, but this process holds "
                            f"replicas {local}: a DiLoCo worker must not span processes. Give "
                            f"replicas_per_worker={len(local)} (this process's) or a divisor of it.")
        self.replicas_per_worker = size
        if size > 1:
            with strategy.scope():
                self._worker_groups = groups.subsets(
                    strategy, [list(range(w, w + size)) for w in range(0, replicas, size)])

    def round_ends(self, start: int, end: int, fragment: int | None = None) -> list[int]:
        """The steps in (start, end) at which a round of `fragment` (default: any) ends."""
        fragments = range(self.fragments) if fragment is None else [fragment]
        found = set()
        for f in fragments:
            offset = self.offsets[f]
            first = offset + ((start - offset) // self.inner_steps + 1) * self.inner_steps
            found.update(t for t in range(first, end, self.inner_steps) if t > 0)
        return sorted(found)

    def cuts(self, start: int, end: int) -> list[int]:
        """The steps in (start, end) after which the loop must end a call: round ends and,
        with overlap, the steps at which a round's outer step applies."""
        ends = self.round_ends(start, end)
        if self.overlap_steps:
            applies = self.round_ends(start - self.overlap_steps, end - self.overlap_steps)
            ends = sorted({*ends, *(t + self.overlap_steps for t in applies)})
        return ends

    def is_round_end(self, step: int, fragment: int = 0) -> bool:
        return step > 0 and (step - self.offsets[fragment]) % self.inner_steps == 0

    def after_call(self, step: int) -> None:
        """What follows a call of the loop that ended after step `step`: a fragment's round
        end runs its outer step (with overlap: takes its delta and codes it); with overlap,
        step t + tau applies the outer step of the fragment's round that ended at t."""
        self._trained = True
        for f in range(self.fragments):
            if self.is_round_end(step, f):
                self._snapshot(f) if self.overlap_steps else self._outer_step(f)  # pylint: disable=expression-not-assigned
            elif self.overlap_steps and self.is_round_end(step - self.overlap_steps, f):
                self._apply(f)

    def launches(self, step: int) -> tuple[int, ...]:
        """The fragments whose exchange the call that starts after step `step` carries (each
        round's once per process: a restored run launches them again from the saved sends)."""
        if not self.overlap_steps:
            return ()
        found = []
        for f in range(self.fragments):
            ends = self.round_ends(step - self.overlap_steps, step + 1, f)
            if ends and self._launched.get(f) != ends[-1]:
                self._launched[f] = ends[-1]
                found.append(f)
        return tuple(found)

    def exchange(self, fragments: Sequence[int] = (0,)) -> None:
        """The collectives of the fragments' exchanges (inside the loop's call, beside its
        steps): every replica's sent code -> the mean outer gradient, in `arrived`."""
        def exchange_one():
            for f in fragments:
                delta, sent, arrived = (private_api.local_component(v) for v in self._in_flight[f])
                with tf.name_scope(f"diloco/outer_{f}"):
                    arrived.assign(self.code.exchange(tf.distribute.get_replica_context(), sent.read_value(),
                                                      int(delta.shape[0])))

        self.strategy.run(exchange_one)

    def outer_step(self) -> None:
        """Averages the replicas' deltas, applies the outer optimizer to the anchor and
        gives every replica the new anchor (every fragment)."""
        for f in range(self.fragments):
            self._outer_step(f)

    @contextlib.contextmanager
    def shared_weights(self) -> Iterator[None]:
        """Every replica's copy holds the shared (outer) weights, the anchor, inside; each
        its own copy again after (evaluation and sampling read the shared model)."""
        from tfpar.tensor_parallel.shards import copies  # pylint: disable=import-outside-toplevel

        saved = [[(copy, copy.read_value()) for _, copy in copies(v)] for v in self._variables]
        for variable, anchor in zip(self._variables, self.anchors):
            variable.assign(anchor)
        try:
            yield
        finally:
            for pairs in saved:
                for copy, value in pairs:
                    copy.assign(value)

    def link_bytes_per_step(self, variables: Sequence, replicas: int) -> float:
        """Bytes a worker transmits per step for the outer exchanges, from the code's payload
        (before build too): a ring all-reduce moves 2 (R - 1) / R of it, an all-gather
        (R - 1) times; each fragment once per `inner_steps` steps."""
        from tfpar.compression import accounting  # pylint: disable=import-outside-toplevel

        sizes = [int(v.shape.num_elements()) for v in variables]
        handed = sum(self.code.payload_bytes(sum(sizes[i] for i in block)) + self.code.shape_exchange_bytes
                     for block in fragment_blocks(sizes, min(self.fragments, len(sizes))))
        return accounting.analytic_link_bytes({self.code.collective: handed}, replicas) / self.inner_steps

    def bytes_per_round(self) -> float:
        """Bytes one replica hands to the outer steps' collectives in H steps (counted from
        their traced graphs: every weight's delta once, in the code's format)."""
        from tfpar.compression import accounting  # pylint: disable=import-outside-toplevel

        return sum(accounting.bytes_per_replica(traced) for traced in self.traced_exchanges())

    def traced_exchanges(self) -> list:
        """The concrete functions whose collectives carry each fragment's outer gradients
        (its outer step; with overlap, the exchange the loop runs beside its steps)."""
        if self.overlap_steps:
            return [tf.function(self.exchange).get_concrete_function((f,)) for f in range(self.fragments)]
        return [self._outer_step.get_concrete_function(f) for f in range(self.fragments)]

    def checkpoint_items(self) -> dict:
        """The anchor and the outer optimizer, by name; across workers also this worker's
        replicas' copies (`diloco_worker_copies`, written to a file of its own)."""
        items = {"diloco_anchor": Tracked(self.anchors), "diloco_outer_optimizer": self.outer_optimizer}
        if self.remainders:
            items["diloco_remainder"] = Tracked(self.remainders, "diloco_remainder")
        if self._in_flight:  # the rounds in flight: each replica's delta and what it sends
            items["diloco_in_flight"] = Tracked(self._sent_state(), "diloco_in_flight")
        if self.worker_copies is not None:
            items["diloco_worker_copies"] = self.worker_copies
        return items

    # -- the outer step --------------------------------------------------------------

    def _sent_state(self) -> list:
        """What a restore needs of the exchanges in flight: each fragment's delta and send."""
        return [v for triple in self._in_flight for v in triple[:2]]

    def _fragment(self, fragment: int) -> tuple[list, list]:
        """(the fragment's variables, their anchors)."""
        indices = self.fragment_variables[fragment]
        return [self._variables[i] for i in indices], [self.anchors[i] for i in indices]

    def _remainder(self, fragment: int):
        """This replica's remainder of the fragment (replica context), or None."""
        return private_api.local_component(self.remainders[fragment]) if self.remainders else None

    def _outer_step_fn(self, fragment: int):
        strategy = self.strategy
        variables, anchors = self._fragment(fragment)

        def outer_update():  # replica context: this replica's copy of each weight
            deltas = [tf.convert_to_tensor(a) - tf.convert_to_tensor(v) for a, v in zip(anchors, variables)]
            own = self._remainder(fragment)
            with tf.name_scope(f"diloco/outer_{fragment}"):
                mean, left = self.code.mean(tf.distribute.get_replica_context(), deltas,
                                            None if own is None else own.read_value())
            if own is not None:
                own.assign(left)  # this replica's remainder, added to its next round's
            self.outer_optimizer.apply(mean, anchors)  # the same mean on every replica's copy

        with private_api.trainer_step(self.outer_optimizer):  # summed already: no second all-reduce
            strategy.run(outer_update)
        for variable, anchor in zip(variables, anchors):
            variable.assign(anchor)  # cross-replica: every copy

    def _snapshot_fn(self, fragment: int):
        """Overlap, at a fragment's round end: each replica's delta (anchor - weights), and
        its coded send (with its remainder kept)."""
        variables, anchors = self._fragment(fragment)

        def snapshot():
            flat = outer_compression.flatten([tf.convert_to_tensor(a) - tf.convert_to_tensor(v)
                                              for a, v in zip(anchors, variables)])
            delta, sent, _ = (private_api.local_component(v) for v in self._in_flight[fragment])
            own = self._remainder(fragment)
            coded = flat if own is None else flat + own.read_value()
            message, decoded = self.code.encode(coded, self.strategy.num_replicas_in_sync)
            delta.assign(flat)
            sent.assign(message)
            if own is not None:
                own.assign(coded - decoded)

        self.strategy.run(snapshot)

    def _apply_fn(self, fragment: int):
        """Overlap, tau steps after a fragment's round end: the outer optimizer on the mean
        that arrived; each replica's weights become the new anchor plus its progress since
        the round's end (weights now - (old anchor - its delta))."""
        variables, anchors = self._fragment(fragment)

        def apply():
            delta, _, arrived = (private_api.local_component(v) for v in self._in_flight[fragment])
            old = [tf.identity(tf.convert_to_tensor(a)) for a in anchors]
            mean = outer_compression.unflatten(arrived.read_value(), old)
            with tf.control_dependencies(old):
                self.outer_optimizer.apply(mean, anchors)
            since = outer_compression.unflatten(delta.read_value(), old)
            for variable, anchor, before, moved in zip(variables, anchors, old, since):
                own = private_api.local_component(variable)
                own.assign(tf.convert_to_tensor(anchor) + own.read_value() - before + moved)

        with private_api.trainer_step(self.outer_optimizer):
            self.strategy.run(apply)


def fragment_blocks(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Consecutive indices of `sizes` in `fragments` non-empty blocks of about equal total
    size: block f ends where the running total first reaches (f + 1) / fragments of it.

    Example:
        >>> fragment_blocks([4, 4, 1, 7], 2)
        [[0, 1], [2, 3]]
    """
    total, blocks, start, running = sum(sizes), [], 0, 0
    for index, size in enumerate(sizes):
        running += size
        left_after = len(sizes) - index - 1  # variables still to place
        wanted = fragments - len(blocks) - 1  # blocks still to open after this one
        if wanted and (running * fragments >= total * (len(blocks) + 1) or left_after == wanted):
            blocks.append(list(range(start, index + 1)))
            start = index + 1
    blocks.append(list(range(start, len(sizes))))
    return blocks
