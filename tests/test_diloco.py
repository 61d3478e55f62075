"""DiLoCo (tfpar.sync.DiLoCo): local inner steps, an outer optimizer on the averaged delta.

On 2 logical CPUs (mirrored): with H = 1, inner SGD and an outer SGD of learning rate 1
without momentum it is synchronous data-parallel SGD; with H > 1 each replica's weights
at the end of a round are a one-device run on that replica's own batches, and the new
shared weights are the outer optimizer applied to the mean of the replicas' deltas.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar.loop import Trainer
from tfpar.sync import DiLoCo, SyncError
from tfpar.tensor_parallel import shards

TOL = 1e-6


def crossentropy():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def trainer_for(strategy, weights, inner, sync=None, **options):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(weights)
        optimizer = inner()
    return model, Trainer(model, optimizer, crossentropy(), strategy=strategy, sync=sync, xla=False, **options)


def global_batches(steps):
    x, y = fit_model.data(steps)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(fit_model.GLOBAL_BATCH)


def replica_batches(replica, replicas, steps):
    return fit_model.replica_dataset(replica, replicas, steps)


def assert_close(actual, expected, tol=TOL):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def sgd():
    return keras.optimizers.SGD(0.1)


def test_one_inner_step_with_a_plain_outer_sgd_is_synchronous_data_parallel_sgd():
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    plain, trainer = trainer_for(strategy, weights, sgd)
    trainer.fit(global_batches(4), steps=4)
    outer = keras.optimizers.SGD(1.0)
    model, trainer = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=1, outer_optimizer=outer))
    trainer.fit(global_batches(4), steps=4)
    moved = max(np.abs(a - b).max() for a, b in zip(plain.get_weights(), weights))
    assert moved > 1e-2
    assert_close(model.get_weights(), plain.get_weights())


def adamw_clip():
    return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=1.0, epsilon=1e-3)  # eps: tests/test_matrix.py


def mean_delta(deltas):
    """float32 outer gradients: their mean over the replicas (a list per replica)."""
    return [np.mean([d[i] for d in deltas], axis=0) for i in range(len(deltas[0]))]


def diloco_reference(weights, inner, rounds, inner_steps=3, accumulate=1, transmit=mean_delta):
    """The shared weights after `rounds` rounds, computed one replica at a time on one
    device: each replica's own optimizer (kept across rounds) takes `inner_steps` steps
    from the anchor on its own batches; `transmit(deltas)` gives the mean outer gradient
    as it arrives; Nesterov SGD(0.7, 0.9) applies it to the anchor."""
    anchor = [tf.Variable(w) for w in weights]
    outer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
    inner_states = []
    for replica in range(2):
        local = fit_model.build_model()
        local.set_weights(weights)
        inner_states.append((local, inner()))
    steps = rounds * inner_steps * accumulate
    for round_ in range(rounds):
        deltas = []
        for replica, (local, optimizer) in enumerate(inner_states):
            local.set_weights([a.numpy() for a in anchor])
            mine = list(replica_batches(replica, 2, steps))[inner_steps * accumulate * round_:]
            for step in range(inner_steps):
                with tf.GradientTape() as tape:
                    loss = tf.add_n([crossentropy()(y, local(x)) for x, y in
                                     mine[step * accumulate:(step + 1) * accumulate]]) / accumulate
                optimizer.apply(tape.gradient(loss, local.trainable_variables), local.trainable_variables)
            deltas.append([a.numpy() - w for a, w in zip(anchor, local.get_weights())])
        outer.apply(transmit(deltas), anchor)
    return [a.numpy() for a in anchor]


@pytest.mark.parametrize("inner,accumulate", [(sgd, 1), (adamw_clip, 1), (adamw_clip, 2)],
                         ids=["sgd", "adamw_clip", "adamw_clip_accumulate_2"])
def test_a_round_is_each_replica_on_its_own_batches_then_the_outer_step_on_the_mean_delta(inner, accumulate):
    """H = 3: the shared weights after the round are Nesterov SGD(0.7, 0.9) applied, from
    the round's start, to the mean over replicas of (start - that replica's weights after 3
    one-device steps on its own batches); the next round starts from them (6 steps). With
    accumulation each inner step is one update on the mean loss of its K micro-batches."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    model, trainer = trainer_for(strategy, weights, inner, sync=DiLoCo(inner_steps=3), accumulate=accumulate)
    trainer.fit(global_batches(6 * accumulate), steps=6)
    expected = diloco_reference(weights, inner, rounds=2, accumulate=accumulate)
    assert max(np.abs(a - b).max() for a, b in zip(expected, weights)) > 1e-2
    assert_close(model.get_weights(), expected, tol=1e-5)
    for variable in model.trainable_variables:  # every replica starts the next round from them
        copies = [c.numpy() for _, c in shards.copies(variable)]
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])


class CodedMean:
    """The outer gradients as a code delivers them, in NumPy (an implementation of its own):
    each replica's flat gradient plus its remainder, coded; the remainder keeps the rest."""

    def __init__(self, code):
        self.code, self.remainders = code, [0.0, 0.0]

    def __call__(self, deltas):
        shapes = [d.shape for d in deltas[0]]
        flats = [np.concatenate([d.ravel() for d in mine]) + r for mine, r in zip(deltas, self.remainders)]
        if self.code == "fp16":
            sent = [np.float16(f / 2) for f in flats]
            mean = (sent[0] + sent[1]).astype(np.float32)  # summed in float16
            arrived = [s.astype(np.float32) * 2 for s in sent]
        else:
            arrived = [self.blocks(f, 127 if self.code == "int8" else 7) for f in flats]
            mean = (arrived[0] + arrived[1]) / 2
        self.remainders = [f - a for f, a in zip(flats, arrived)]
        cuts = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
        return [part.reshape(s) for part, s in zip(np.split(mean, cuts), shapes)]

    @staticmethod
    def blocks(flat, levels, block=256):
        padded = np.pad(flat, (0, -len(flat) % block)).reshape(-1, block)
        scales = (np.abs(padded).max(axis=1) / levels).astype(np.float32)
        safe = np.where(scales > 0, scales, 1).astype(np.float32)
        q = np.clip(np.round(padded / safe[:, None]), -levels, levels)  # half to even, as tf.round
        return (q * scales[:, None]).astype(np.float32).ravel()[:len(flat)]


@pytest.mark.parametrize("code", ["fp16", pytest.param("int8", marks=pytest.mark.slow), "int4"])  # int8: int4's path
def test_coded_outer_gradients_arrive_as_the_code_gives_them_with_the_rest_kept_for_the_next_round(code):
    """H = 2, 3 rounds, AdamW with a clip: the shared weights are the outer optimizer on
    the mean of the coded outer gradients, each replica adding what its code left behind
    last round (error feedback), computed in NumPy (1e-5); the coded run differs from the
    float32 one (the code does something) and stays near it."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    model, trainer = trainer_for(strategy, weights, adamw_clip, sync=DiLoCo(inner_steps=2, compression=code))
    trainer.fit(global_batches(6), steps=6)
    expected = diloco_reference(weights, adamw_clip, rounds=3, inner_steps=2, transmit=CodedMean(code))
    assert_close(model.get_weights(), expected, tol=1e-5)
    plain = diloco_reference(weights, adamw_clip, rounds=3, inner_steps=2)
    off = max(np.abs(a - b).max() for a, b in zip(expected, plain))
    assert 1e-7 < off < 1e-2, off
    remainders = [c.numpy() for _, c in shards.copies(trainer._sync.remainders[0])]  # pylint: disable=protected-access
    assert not np.array_equal(*remainders)  # each replica keeps its own


def streaming_reference(weights, inner, steps, inner_steps, overlap=0, fragments=None, transmit=lambda: mean_delta):
    """(shared weights, each replica's weights) after `steps` steps of DiLoCo, one replica
    at a time on one device. `fragments`: lists of weight indices (default: one, every
    weight); fragment f's rounds end at the steps f * H // F (mod H), and its outer
    gradients go through its own `transmit()`. At a round's end t each replica's delta of
    the fragment is taken; after step t + overlap the outer optimizer applies the mean to
    the fragment's anchor and each replica's weights of it become the new anchor plus what
    its own steps since t moved them (overlap 0: the anchor itself)."""
    fragments = fragments or [list(range(len(weights)))]
    offsets = [f * inner_steps // len(fragments) for f in range(len(fragments))]
    codes = [transmit() for _ in fragments]
    anchor = [tf.Variable(w) for w in weights]
    outer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
    outer.build(anchor)  # a momentum per weight; each fragment's update applies its own
    replicas = []
    for replica in range(2):
        local = fit_model.build_model()
        local.set_weights(weights)
        replicas.append((local, inner(), list(replica_batches(replica, 2, steps))))
    pending = {}
    for step in range(1, steps + 1):
        for local, optimizer, batches in replicas:
            x, y = batches[step - 1]
            with tf.GradientTape() as tape:
                loss = crossentropy()(y, local(x))
            optimizer.apply(tape.gradient(loss, local.trainable_variables), local.trainable_variables)
        for f, indices in enumerate(fragments):
            if (step - offsets[f]) % inner_steps == 0:
                pending[f] = [[anchor[i].numpy() - local.get_weights()[i] for i in indices] for local, _, _ in replicas]
            if step - overlap > 0 and (step - overlap - offsets[f]) % inner_steps == 0:
                deltas = pending.pop(f)
                old = [anchor[i].numpy() for i in indices]
                outer.apply(codes[f](deltas), [anchor[i] for i in indices])
                for (local, _, _), delta in zip(replicas, deltas):
                    now = local.get_weights()
                    for i, o, d in zip(indices, old, delta):
                        now[i] = anchor[i].numpy() + now[i] - o + d
                    local.set_weights(now)
    return [a.numpy() for a in anchor], [local.get_weights() for local, _, _ in replicas]


def assert_every_copy(model, expected_per_replica, tol=1e-5):
    for index, variable in enumerate(model.trainable_variables):
        for replica, copy in shards.copies(variable):
            np.testing.assert_allclose(copy.numpy(), expected_per_replica[replica][index], rtol=tol, atol=tol)


@pytest.mark.parametrize("overlap,code", [pytest.param(1, None, marks=pytest.mark.slow), (2, "int4")],
                         ids=["overlap_1", "overlap_2_int4"])
def test_an_overlapped_exchange_applies_tau_steps_later_keeping_each_replicas_progress(overlap, code):
    """H = 3, AdamW with a clip, 8 steps (rounds end at 3 and 6; their outer steps apply
    after 3 + tau and 6 + tau): every replica's copy and the shared weights equal the
    reference schedule computed one replica at a time (1e-5), int4's error feedback too;
    the round's collective is in the loop's call that runs the steps after the round's end,
    and in no other."""
    from tfpar.compression import accounting

    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    sync = DiLoCo(inner_steps=3, overlap_steps=overlap, compression=code)
    model, trainer = trainer_for(strategy, weights, adamw_clip, sync=sync)
    trainer.fit(global_batches(8), steps=8)
    shared, locals_ = streaming_reference(weights, adamw_clip, 8, 3, overlap,
                                          transmit=(lambda: CodedMean(code)) if code else (lambda: mean_delta))
    assert max(np.abs(a - b).max() for a, b in zip(shared, weights)) > 1e-2
    assert_close([a.numpy() for a in sync.anchors], shared, tol=1e-5)
    assert_every_copy(model, locals_)
    dataset = strategy.experimental_distribute_dataset(global_batches(2))
    args = (iter(dataset), tf.constant(1), trainer._phase(0))  # pylint: disable=protected-access
    beside = accounting.collectives(trainer._train_loop_exchanging.get_concrete_function(*args))  # pylint: disable=protected-access
    assert [c for c in beside if c.type in ("CollectiveGatherV2", "CollectiveReduceV2") and (c.bytes or 0) > 64]
    assert not [c for c in accounting.collectives(trainer.traced_step(dataset)) if (c.bytes or 0) > 64]
    with pytest.raises(SyncError, match="overlap_steps=3 with inner_steps=3"):
        DiLoCo(inner_steps=3, overlap_steps=3)


def test_fragments_are_consecutive_blocks_of_about_equal_size():
    from tfpar.sync.diloco import fragment_blocks

    assert fragment_blocks([4, 4, 1, 7], 2) == [[0, 1], [2, 3]]
    assert fragment_blocks([100, 1, 1], 3) == [[0], [1], [2]]  # every block holds a variable
    sizes = [int(np.prod(w.shape)) for w in fit_model.initial_weights()]
    for count in (1, 2, 3, 5):
        blocks = fragment_blocks(sizes, count)
        assert len(blocks) == count and [i for b in blocks for i in b] == list(range(len(sizes)))
        for block in blocks:
            assert abs(sum(sizes[i] for i in block) - sum(sizes) / count) < max(sizes)


@pytest.mark.parametrize("fragments,inner_steps,overlap,code", [(2, 4, 0, None), (3, 6, 2, "int4")],
                         ids=["F2_H4", "F3_H6_overlap_2_int4"])
def test_streaming_fragments_are_each_exchanged_on_their_own_steps_as_the_reference_schedule(
        fragments, inner_steps, overlap, code):
    """Streaming DiLoCo, AdamW with a clip, 12 steps: fragment f's round ends after the
    steps f * H // F (mod H) and no others (its outer step, or with overlap its snapshot,
    runs there: recorded); each fragment's exchange carries its own weights only (bytes
    counted from its traced graph = the code's payload for the fragment's size); the shared
    weights and every replica's copy equal the schedule computed one replica at a time in
    NumPy, each fragment with its own code and remainder (1e-5)."""
    from tfpar.compression import accounting
    from tfpar.sync import outer_compression

    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    sync = DiLoCo(inner_steps=inner_steps, fragments=fragments, overlap_steps=overlap, compression=code)
    model, trainer = trainer_for(strategy, weights, adamw_clip, sync=sync)
    ran = []
    name = "_snapshot" if overlap else "_outer_step"
    real = getattr(sync, name)
    setattr(sync, name, lambda f: (ran.append((trainer.step, f)), real(f))[1])
    trainer.fit(global_batches(12), steps=12)
    setattr(sync, name, real)
    offsets = [f * inner_steps // fragments for f in range(fragments)]
    assert ran == [(t, f) for t in range(1, 13) for f in range(fragments) if (t - offsets[f]) % inner_steps == 0]
    assert len({t for t, _ in ran}) == len(ran)  # one fragment a round end
    shared, locals_ = streaming_reference(weights, adamw_clip, 12, inner_steps, overlap, sync.fragment_variables,
                                          transmit=(lambda: CodedMean(code)) if code else (lambda: mean_delta))
    assert max(np.abs(a - b).max() for a, b in zip(shared, weights)) > 1e-2
    assert_close([a.numpy() for a in sync.anchors], shared, tol=1e-5)
    assert_every_copy(model, locals_)
    sizes = [int(np.prod(w.shape)) for w in weights]
    shape_exchange = 8 if code else 0  # an all-gather first exchanges its input's shape
    traced = sync.traced_exchanges()
    assert len(traced) == fragments
    for indices, exchange in zip(sync.fragment_variables, traced):
        payload = outer_compression.outer_code(code).payload_bytes(sum(sizes[i] for i in indices))
        assert accounting.bytes_per_replica(exchange) == payload + shape_exchange
    wire = trainer.wire_bytes(strategy.experimental_distribute_dataset(global_batches(1)))
    assert wire["bytes_per_step"] == pytest.approx(sync.bytes_per_round() / inner_steps)


def test_a_coded_outer_step_gathers_the_analytic_payload():
    """int4 on 2 replicas: one all-gather of every weight in 4 bits plus a float32 scale
    per 256 values (and the gather's 8-byte shape exchange), counted from the traced outer
    step; the wire bytes per step are it spread over the round."""
    from tfpar.compression import accounting
    from tfpar.sync import outer_compression

    strategy = mirrored(2)
    sync = DiLoCo(inner_steps=4, compression="int4")
    model, trainer = trainer_for(strategy, fit_model.initial_weights(), sgd, sync=sync)
    size = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    found = accounting.collectives(sync.traced_exchanges()[0])
    assert {c.type for c in found} == {"CollectiveGatherV2"}
    blocks = -(-size // 256)
    assert outer_compression.BlockCode(4).payload_bytes(size) == 4 * (blocks + blocks * 256 // 8)
    shape_exchange = 8  # the all-gather first exchanges its input's shape, [1, W] in int32
    assert sync.bytes_per_round() == outer_compression.BlockCode(4).payload_bytes(size) + shape_exchange
    wire = trainer.wire_bytes(strategy.experimental_distribute_dataset(global_batches(1)))
    assert wire["bytes_per_step"] == sync.bytes_per_round() / 4
    with pytest.raises(SyncError, match="compression='int2': give one of none, fp16, int8, int4"):
        DiLoCo(inner_steps=2, compression="int2")


def test_no_collective_in_the_inner_steps_and_one_all_reduce_of_the_weights_per_round():
    """Counted from the traced graphs: the inner step has none (synchronous data
    parallelism's has its all-reduce and the embedding rows' gathers); the outer step
    all-reduces every weight once (both replicas' launches counted)."""
    from tfpar.compression import accounting

    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(global_batches(2))
    model, plain = trainer_for(strategy, fit_model.initial_weights(), sgd)
    weight_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert accounting.collectives(plain.traced_step(dataset))  # the count sees them
    sync = DiLoCo(inner_steps=2)
    _, trainer = trainer_for(strategy, fit_model.initial_weights(), sgd, sync=sync)
    assert accounting.collectives(trainer.traced_step(dataset)) == []
    outer = [c for c in accounting.collectives(sync.traced_exchanges()[0]) if c.type == "CollectiveReduceV2"]
    assert sum(c.bytes for c in outer) == 2 * weight_bytes


def test_bad_settings_and_combinations_are_refused_by_name():
    with pytest.raises(SyncError, match="inner_steps=0: give the number of local steps"):
        DiLoCo(inner_steps=0)
    for fragments in (0, 5, 1.5):
        with pytest.raises(SyncError, match=f"fragments={fragments!r} with inner_steps=4: .* from 1 to inner_steps"):
            DiLoCo(inner_steps=4, fragments=fragments)
    with pytest.raises(SyncError, match="fragments=20: the model has 19 trainable variable"):
        trainer_for(mirrored(2), fit_model.initial_weights(), sgd, sync=DiLoCo(inner_steps=20, fragments=20))
    with pytest.raises(SyncError, match=r"DiLoCo\(inner_steps=2\) with shard: .* Use one of them"):
        trainer_for(mirrored(2), fit_model.initial_weights(), sgd, sync=DiLoCo(inner_steps=2), shard="optimizer")
    with pytest.raises(SyncError, match="with compression or an aggregator"):
        trainer_for(mirrored(2), fit_model.initial_weights(), sgd, sync=DiLoCo(inner_steps=2),
                    compression=tfpar.compression.FP16())


@pytest.mark.parametrize("stop,code,overlap", [(4, None, 0), pytest.param(4, "int4", 0, marks=pytest.mark.slow),
                                               (4, "int4", 2),
                                               pytest.param(6, None, 0, marks=pytest.mark.slow)],
                         ids=["mid_round", "mid_round_int4", "in_flight_int4", "round_end"])
def test_a_run_stopped_mid_round_resumes_onto_the_uninterrupted_run(tmp_path, stop, code, overlap):
    """H = 3, AdamW: stopped at step 4 (mid-round: the replicas' weights and moments differ;
    with int4 outer gradients, their remainders too; with an exchange overlapping 2 steps,
    the round ended at 3 is in flight) or 6, saved by tfpar's Checkpoints, restored into a
    new Trainer, trained to step 9: the uninterrupted run's weights, every replica's copy
    (1e-6)."""
    assert_resumes_onto_the_uninterrupted_run(
        tmp_path, lambda: DiLoCo(inner_steps=3, compression=code, overlap_steps=overlap), stop, 9)


@pytest.mark.parametrize("stop,in_flight", [pytest.param(1, 0, marks=pytest.mark.slow),
                                             pytest.param(5, 1, marks=pytest.mark.slow),
                                             pytest.param(6, 2, marks=pytest.mark.slow)],
                         ids=["none_in_flight", "one", "two"])
def test_streaming_resumes_onto_the_uninterrupted_run_whatever_is_in_flight(tmp_path, stop, in_flight):
    """2 fragments, H = 4 (rounds end at 4, 8, ... and 2, 6, ...), int4, each exchange
    beside the next 3 steps: stopped at step 1 (nothing in flight), 5 (fragment 0's round
    ended at 4) or 6 (that one and fragment 1's ended at 6), resumed to step 12: the
    uninterrupted run's weights, every replica's copy (1e-6)."""
    def streaming():
        return DiLoCo(inner_steps=4, fragments=2, compression="int4", overlap_steps=3)

    sync = streaming()
    assert len(sync.launches(stop)) == in_flight  # what the restored run launches again
    assert_resumes_onto_the_uninterrupted_run(tmp_path, streaming, stop, 12)


def assert_resumes_onto_the_uninterrupted_run(tmp_path, make_sync, stop, steps):
    """AdamW; one run of `steps` steps, and one stopped at `stop`, saved by tfpar's
    Checkpoints, restored into a new Trainer and trained on: equal, every replica's copy."""
    from tfpar.checkpoints import Checkpoints

    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    adamw = lambda: keras.optimizers.AdamW(0.01, epsilon=1e-3)  # noqa: E731

    def run(start, end, workdir=None):
        model, trainer = trainer_for(strategy, weights, adamw, sync=make_sync())
        checkpoints = None if workdir is None else Checkpoints(
            str(workdir), True, model=model, optimizer=trainer.optimizer, **trainer.checkpoint_items())
        if checkpoints is not None and start:
            assert checkpoints.restore() == start
        trainer.fit(global_batches(steps).skip(start), steps=end, start_step=start)
        if checkpoints is not None:
            checkpoints.save(end)
        return model

    whole = run(0, steps)
    run(0, stop, tmp_path)
    resumed = run(stop, steps, tmp_path)
    for a, b in zip(resumed.trainable_variables, whole.trainable_variables):
        for (_, x), (_, y) in zip(shards.copies(a), shards.copies(b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=TOL, atol=TOL, err_msg=a.path)


def test_a_users_own_tf_checkpoint_resumes_with_diloco_state_and_is_refused_by_name_without(tmp_path):
    """H = 3, Nesterov outer step: a tf.train.Checkpoint written at step 4 (mid-round) with
    `**trainer.checkpoint_items()` resumes onto the uninterrupted run (every copy, 1e-6);
    one without them (the model and optimizer only, as TF users write) restores the
    replicas' copies but not the anchor, and the next fit refuses it by name, before a step."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    model, trainer = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=3))
    trainer.fit(global_batches(4), steps=4)
    whole = tf.train.Checkpoint(model=model, optimizer=trainer.optimizer, **trainer.checkpoint_items())
    with_state = whole.write(str(tmp_path / "with_state"))
    without = tf.train.Checkpoint(model=model, optimizer=trainer.optimizer).write(str(tmp_path / "without"))
    trainer.fit(global_batches(9).skip(4), steps=9, start_step=4)

    resumed, again = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=3))
    tf.train.Checkpoint(model=resumed, optimizer=again.optimizer, **again.checkpoint_items()).read(with_state)
    again.fit(global_batches(9).skip(4), steps=9, start_step=4)
    for a, b in zip(resumed.trainable_variables, model.trainable_variables):
        for (_, x), (_, y) in zip(shards.copies(a), shards.copies(b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=TOL, atol=TOL, err_msg=a.path)

    lost, refusing = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=3))
    tf.train.Checkpoint(model=lost, optimizer=refusing.optimizer).read(without)
    restored = [c.numpy() for _, c in shards.copies(lost.trainable_variables[0])]
    with pytest.raises(SyncError, match=r"restored the model's weights without DiLoCo's anchor.*checkpoint_items"):
        refusing.fit(global_batches(9).skip(4), steps=9, start_step=4)
    with pytest.raises(SyncError, match="without DiLoCo's anchor"):  # evaluation and sampling too
        refusing.shared_weights()
    for kept, (_, copy) in zip(restored, shards.copies(lost.trainable_variables[0])):
        np.testing.assert_array_equal(kept, copy.numpy())  # refused before any step


def test_weights_loaded_into_a_fresh_trainer_start_diloco_and_loaded_after_training_are_refused(tmp_path):
    """Keras's load_weights into a Trainer that has not stepped: DiLoCo starts from the
    loaded weights, as a Trainer made after the load does (1e-6; with the anchor left at
    the weights the Trainer was made with, the Nesterov outer step would move elsewhere).
    Loaded after training began: refused by name at the next fit and shared_weights."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    source = fit_model.build_model()
    source.set_weights([w * 0.5 + 0.01 for w in weights])
    path = str(tmp_path / "pretrained.weights.h5")
    source.save_weights(path)

    loaded_late, trainer = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=3))
    loaded_late.load_weights(path)
    trainer.fit(global_batches(6), steps=6)
    made_after, _ = trainer_for(strategy, source.get_weights(), sgd, sync=DiLoCo(inner_steps=3))
    _.fit(global_batches(6), steps=6)
    assert_close([v.numpy() for v in loaded_late.trainable_variables],
                 [v.numpy() for v in made_after.trainable_variables])

    loaded_late.load_weights(path)
    with pytest.raises(SyncError, match=r"changed outside the Trainer.*after it trained.*checkpoint_items"):
        trainer.fit(global_batches(9).skip(6), steps=9, start_step=6)
    with pytest.raises(SyncError, match="changed outside the Trainer"):
        trainer.shared_weights()


def test_evaluation_mid_round_reads_the_shared_weights_and_training_goes_on():
    """At step 4 of rounds of 3 the replicas' copies differ; evaluate() scores the anchor
    (the shared weights: an unsplit model holding them scores the same), every copy holds
    the anchor inside `trainer.shared_weights()`, and each replica has its own copy after."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    model, trainer = trainer_for(strategy, weights, sgd, sync=DiLoCo(inner_steps=3))
    trainer.fit(global_batches(4), steps=4)
    before = [[c.numpy() for _, c in shards.copies(v)] for v in model.trainable_variables]
    assert any(not np.array_equal(*pair) for pair in before)  # mid-round: the copies differ
    x, y = fit_model.data(1)
    data = tf.data.Dataset.from_tensor_slices((x, y, np.ones(len(y), "float32"))).batch(8)
    got = trainer.evaluate(strategy.experimental_distribute_dataset(data), steps=2)
    shared = fit_model.build_model()
    shared.set_weights([a.numpy() for a in trainer._sync.anchors])  # pylint: disable=protected-access
    expected = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, shared(x), from_logits=True)))
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)
    with trainer.shared_weights():  # what sampling and a save read: the anchor, every copy
        for variable, anchor in zip(model.trainable_variables, trainer._sync.anchors):  # pylint: disable=protected-access
            for _, copy in shards.copies(variable):
                np.testing.assert_array_equal(copy.numpy(), anchor.numpy())
    after = [[c.numpy() for _, c in shards.copies(v)] for v in model.trainable_variables]
    for b, a in zip(before, after):
        for u, v in zip(b, a):
            np.testing.assert_array_equal(u, v)


def test_the_progress_line_names_the_rounds_done():
    from tfpar.callbacks import ProgressLine

    lines = []
    progress = ProgressLine(60, say=lines.append, round_steps=25)
    progress.start(0)
    assert progress.report(50, 1.0)["rounds"] == 2 and "| round 2/2 |" in lines[-1]
    assert progress.report(60, 1.0)["rounds"] == 2
    assert "round" not in ProgressLine(60, say=lines.append).report(10, 1.0)


@pytest.mark.slow  # three binary runs on 4 replicas: about 3 minutes
def test_the_binary_trains_with_parallel_sync_diloco_and_resumes_at_its_step(tmp_path):
    """--config.parallel.sync=diloco --config.parallel.inner_steps=2
    --config.parallel.outer_compression=fp16 --config.parallel.fragments=2 on 4 logical
    CPUs: stopped at step 3 (mid-round, after rounds of each fragment with their
    remainders) and resumed, it ends at step 6 on the uninterrupted run's weights and
    remainders (1e-5); results.json says DiLoCo, its rounds, fragments and code, and a ratio
    of 4 (half the model in fp16 every step)."""
    from tfpar.config import base_config
    from tfpar.train import train_and_evaluate
    from tfpar.config import validate

    def config_for(steps):
        config = base_config()
        config.mode, config.strategy = "loop", "mirrored"  # 4 logical CPUs: 4 replicas
        config.parallel.update(sync="diloco", inner_steps=2, outer_compression="fp16", fragments=2)
        config.model_args.update(dim=32, depth=1, heads=4)
        config.data.seq_len = 16
        config.train.update(steps=steps, batch_size=8, steps_per_loop=1, log_every=1, checkpoint_every=3,
                            eval_examples=16, eval_batch_size=8, xla=False)
        config.optimizer.update(schedule="constant")  # a stopped run's schedule spans its own steps
        config.sample.length = 0
        validate(config)
        return config

    train_and_evaluate(config_for(6), str(tmp_path / "whole"))
    with open(tmp_path / "whole" / "results.json", encoding="utf-8") as f:
        results = json.load(f)
    assert (results["sync"], results["inner_steps"], results["rounds"], results["outer_compression"],
            results["fragments"]) == ("diloco", 2, 3, "fp16", 2)
    assert results["compression_ratio"] == pytest.approx(4.0, rel=1e-3)  # an fp16 all-reduce every 2 steps
    train_and_evaluate(config_for(3), str(tmp_path / "resumed"))
    train_and_evaluate(config_for(6), str(tmp_path / "resumed"))
    a, b = (tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / d / "checkpoints")))
            for d in ("whole", "resumed"))
    names = sorted(n for n in a.get_variable_to_shape_map()
                   if "save_counter" not in n and not n.startswith("_CHECKPOINTABLE"))
    assert any("REPLICA_COPIES" in n for n in names) and any("diloco_anchor" in n for n in names), names
    assert len([n for n in names if "diloco_remainder" in n and "REPLICA_COPIES" in n]) == 2, names
    assert names == sorted(n for n in b.get_variable_to_shape_map()
                           if "save_counter" not in n and not n.startswith("_CHECKPOINTABLE"))
    for name in names:
        np.testing.assert_allclose(b.get_tensor(name), a.get_tensor(name), rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_binary_refuses_what_diloco_does_not_compose_with():
    from tfpar.config import base_config
    from tfpar.errors import ConfigError
    from tfpar.config import validate

    for parallel, mode, message in [
            (dict(sync="diloco", shard="optimizer"), "loop", "config.parallel.sync: diloco with shard is not built"),
            (dict(sync="diloco"), "fit", "config.parallel.sync: DiLoCo runs in tfpar's loop"),
            (dict(inner_steps=5), "loop", "config.parallel.inner_steps: applies to parallel.sync=diloco"),
            (dict(sync="diloco", inner_steps=0), "loop", "config.parallel.inner_steps: must be a positive integer"),
            (dict(sync="diloco", outer_compression="int2"), "loop",
             "config.parallel.outer_compression: must be one of none, fp16, int8, int4"),
            (dict(outer_compression="int4"), "loop", "config.parallel.outer_compression: applies to parallel.sync"),
            (dict(sync="diloco", inner_steps=4, overlap_steps=4), "loop",
             r"config.parallel.overlap_steps: must be an integer from 0 to inner_steps - 1 \(3\)"),
            (dict(sync="diloco", inner_steps=4, fragments=5), "loop",
             r"config.parallel.fragments: must be an integer from 1 to inner_steps \(4\), got 5"),
            (dict(fragments=2), "loop", "config.parallel.fragments: applies to parallel.sync=diloco")]:
        config = base_config()
        config.mode = mode
        config.parallel.update(**parallel)
        with pytest.raises(ConfigError, match=message):
            validate(config)


def test_the_wire_bytes_per_step_are_the_outer_all_reduce_spread_over_its_round():
    strategy = mirrored(2)
    model, trainer = trainer_for(strategy, fit_model.initial_weights(), sgd, sync=DiLoCo(inner_steps=4))
    wire = trainer.wire_bytes(strategy.experimental_distribute_dataset(global_batches(1)))
    weight_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert wire["bytes_per_step"] == weight_bytes / 4 and wire["ratio"] == 4.0


@pytest.mark.parametrize("policy", ["mixed_float16", pytest.param("mixed_bfloat16", marks=pytest.mark.slow)])
def test_mixed_precision_inner_steps_train_like_float32(policy):
    """The inner steps as the loop does them under a mixed policy (fp16: Keras's loss-scale
    optimizer, its scale per replica): after 2 rounds of H = 3 the shared weights are the
    float32 run's to the policy's precision, and every replica holds them."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    expected, trainer = trainer_for(strategy, weights, adamw_clip, sync=DiLoCo(inner_steps=3))
    trainer.fit(global_batches(6), steps=6)
    keras.mixed_precision.set_global_policy(policy)
    try:
        def inner():
            optimizer = adamw_clip()
            return keras.optimizers.LossScaleOptimizer(optimizer) if policy == "mixed_float16" else optimizer

        model, trainer = trainer_for(strategy, weights, inner, sync=DiLoCo(inner_steps=3))
        trainer.fit(global_batches(6), steps=6)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    moved = max(np.abs(a - b).max() for a, b in zip(expected.get_weights(), weights))
    assert moved > 1e-2
    assert_close(model.get_weights(), expected.get_weights(), tol=moved * (0.02 if policy == "mixed_bfloat16" else 0.005))
    for variable in model.trainable_variables:
        copies = [c.numpy() for _, c in shards.copies(variable)]
        np.testing.assert_array_equal(copies[0], copies[1])


@pytest.mark.multiprocess
def test_two_worker_processes_train_and_resume_mid_round_as_two_replicas_do(tmp_path):
    """Under multi_worker_mirrored, one replica per worker process, each worker its own
    slice of each batch: H = 1 with an outer SGD(1) is the workers' synchronous SGD (1e-6);
    H = 3 (AdamW, int4 outer gradients, 9 steps) is the 2-replica mirrored run of this
    module (1e-6), the same on both workers; stopped at step 4, where the workers' copies
    and remainders differ, each worker's own copies are written to its own file
    (checkpoints/workers/worker-k) and read back, and the run resumed to step 9 is the
    uninterrupted one."""
    from procs import launch

    init = fit_model.initial_weights()
    np.savez(tmp_path / "init.npz", **{f"w{i}": w for i, w in enumerate(init)})
    workdir = tmp_path / "run"
    result = launch(2, "diloco_worker.py", str(tmp_path / "init.npz"), str(tmp_path), str(workdir))
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert out.count("STRATEGY multi_worker_mirrored replicas=2 workers=2") == 2 and out.count("DONE") == 2, out[-4000:]
    assert out.count("REFUSED True") == 2, out[-4000:]  # a user's own tf.train.Checkpoint

    def weights(name, task):
        found = np.load(tmp_path / f"{name}{task}.npz")
        return [found[f"arr_{i}"] for i in range(len(found.files))]

    assert_close(weights("h1_", 0), weights("sync", 0))
    assert max(np.abs(a - b).max() for a, b in zip(weights("sync", 0), init)) > 1e-2
    model, trainer = trainer_for(mirrored(2), init, lambda: keras.optimizers.AdamW(0.01, epsilon=1e-3),
                                 sync=DiLoCo(inner_steps=3, compression="int4"))
    trainer.fit(global_batches(9), steps=9)
    for task in (0, 1):
        assert_close(weights("whole", task), model.get_weights())
        assert_close(weights("resumed", task), model.get_weights())
    differ = max(np.abs(a - b).max() for a, b in zip(weights("mid_round", 0), weights("mid_round", 1)))
    assert differ > 1e-3  # what the per-worker files keep
    assert sorted(p.name for p in (workdir / "checkpoints" / "workers").iterdir()) == ["worker-0", "worker-1"]


def test_train_steps_across_round_ends_runs_the_outer_steps_as_fit_does():
    """`train_steps(iterator, 7)` with H = 3 (a benchmark's or a controller's call) cuts at
    steps 3 and 6 and runs the outer step there: fit's weights (1e-6)."""
    weights = fit_model.initial_weights()
    strategy = mirrored(2)
    expected, trainer = trainer_for(strategy, weights, adamw_clip, sync=DiLoCo(inner_steps=3))
    trainer.fit(global_batches(7), steps=7)
    model, trainer = trainer_for(strategy, weights, adamw_clip, sync=DiLoCo(inner_steps=3))
    trainer.train_steps(iter(strategy.experimental_distribute_dataset(global_batches(7))), 7)
    assert trainer.step == 7
    for a, b in zip(model.trainable_variables, expected.trainable_variables):
        for (_, x), (_, y) in zip(shards.copies(a), shards.copies(b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=TOL, atol=TOL, err_msg=a.path)


@pytest.mark.slow  # 30 s, moved for the fast tier's 10-minute budget
def test_replicas_grouped_into_workers_train_as_one_worker_each():
    """The hierarchical form: 4 replicas as 2 DiLoCo workers of 2 (their gradients summed
    inside the worker every step, DiLoCo between workers) is the 2-replica run, each worker's
    replicas holding one copy (H = 3, AdamW with a clip, stopped mid-round at step 4 and
    at step 6); a group that does not divide the replicas is refused by name."""
    weights = fit_model.initial_weights()
    for steps in (4, 6):
        expected, trainer = trainer_for(mirrored(2), weights, adamw_clip, sync=DiLoCo(inner_steps=3))
        trainer.fit(global_batches(steps), steps=steps)
        model, trainer = trainer_for(mirrored(4), weights, adamw_clip,
                                     sync=DiLoCo(inner_steps=3, replicas_per_worker=2))
        trainer.fit(global_batches(steps), steps=steps)
        for a, b in zip(model.trainable_variables, expected.trainable_variables):
            mine = [c.numpy() for _, c in shards.copies(a)]
            want = [c.numpy() for _, c in shards.copies(b)]
            for replica, copy in enumerate(mine):  # replicas 0, 1: worker 0; 2, 3: worker 1
                np.testing.assert_allclose(copy, want[replica // 2], rtol=1e-5, atol=1e-5, err_msg=a.path)
    with pytest.raises(SyncError, match="replicas_per_worker=3 does not divide the 4 replicas"):
        trainer_for(mirrored(4), weights, sgd, sync=DiLoCo(inner_steps=3, replicas_per_worker=3))
