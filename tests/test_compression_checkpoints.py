"""Compression state through checkpoints: every replica its own state back, a resumed run
that continues as the uninterrupted one, another replica count, checkpoints from before."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mirrored, mlp_data, mlp_weights, trainer_for  # noqa: F401 (a fixture)
from tfpar import compression as C
from tfpar.checkpoints import Checkpoints
from tfpar.compression import replica_state


def named_mlp():
    """test_compression's mlp with fixed layer names: a fresh model in this process has the
    same variable paths, so its compression state has the same checkpoint names."""
    inputs = keras.Input((32,))
    x = keras.layers.Dense(64, activation="relu", name="ckpt_dense")(inputs)
    x = keras.layers.LayerNormalization(name="ckpt_norm")(x)
    x = keras.layers.Dense(64, activation="relu", name="ckpt_dense_1")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="ckpt_dense_2")(x))


def trained(strategy, compression, weights, steps=3):
    """The Trainer after `steps` steps; each replica trains on its half of every batch."""
    _, trainer = trainer_for(strategy, named_mlp, weights, compression)
    trainer.fit(strategy.experimental_distribute_dataset(mlp_data()), steps=steps)
    return trainer


def fresh(strategy, compression, weights):
    """`compression` built by a new Trainer on a new model (state at its start)."""
    return trainer_for(strategy, named_mlp, weights, compression)[1].aggregator


def per_replica(compression, strategy) -> dict:
    """{path: [each replica's value]} of the compression's state."""
    return {path: [v.numpy() for v in strategy.experimental_local_results(variable)]
            for path, variable in replica_state.state_by_path(compression)}


def save(trainer, tmp_path) -> str:
    return tf.train.Checkpoint(**trainer.checkpoint_items()).save(str(tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def topk_two(mlp_weights, tmp_path_factory):
    """(strategy, trainer, its per-replica state, its checkpoint): topk on 2 replicas, 3 steps."""
    strategy = mirrored(2)
    trainer = trained(strategy, C.TopK(0.05), mlp_weights)
    return strategy, trainer, per_replica(trainer.aggregator, strategy), save(trainer, tmp_path_factory.mktemp("topk"))


def test_every_replica_gets_its_own_state_back(topk_two, mlp_weights, monkeypatch):
    """Two replicas on different data owe different residuals; a restore into fresh objects
    gives each its own, bit for bit (not their mean), also when it runs before the state
    exists (restored when the Trainer builds it). A restore never computes the rows it
    would save (under multi_worker_mirrored, a gather every worker would have to reach)."""
    strategy, _, saved, path = topk_two
    assert saved and all(np.abs(a - b).max() > 0 for a, b in saved.values())
    restored = fresh(strategy, C.TopK(0.05), mlp_weights)
    early = C.Compression(C.TopK(0.05))

    def computed(*_):
        raise AssertionError("a restore computed the per-replica rows it would save")

    with monkeypatch.context() as patched:
        patched.setattr(replica_state.ReplicaValue, "_rows", computed)
        tf.train.Checkpoint(compression=restored).restore(path).assert_consumed()
        tf.train.Checkpoint(compression=early).restore(path)  # before build: deferred
        fresh(strategy, early, mlp_weights)
    for compression in (restored, early):
        got = per_replica(compression, strategy)
        assert got.keys() == saved.keys()
        for name, values in got.items():
            for value, own in zip(values, saved[name]):
                np.testing.assert_array_equal(value, own, err_msg=name)
    assert C.Compression(C.TopK(0.05), reset_on_restore=True).checkpoint_items() == {}


def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path, mlp_weights):
    """Trainer + tfpar's Checkpoints, as the training binary resumes (topk with error
    feedback, 2 replicas): stopped at step 3 and resumed == uninterrupted at step 6, weights
    and every replica's residual. Each replica's top-k is picked from its own residual:
    resumed from their mean, the weights differ."""
    strategy, steps = mirrored(2), 6

    def run(workdir, start, stop):
        model, trainer = trainer_for(strategy, named_mlp, mlp_weights, C.TopK(0.05))
        checkpoints = Checkpoints(str(workdir), True, model=model, optimizer=trainer.optimizer,
                                  **trainer.checkpoint_items())
        assert checkpoints.restore() == start
        data = strategy.experimental_distribute_dataset(mlp_data(steps=steps).skip(start))
        trainer.fit(data, steps=stop, start_step=start)
        checkpoints.save(stop)
        return model.get_weights(), per_replica(trainer.aggregator, strategy)

    weights, state = run(tmp_path / "straight", 0, steps)
    run(tmp_path / "resumed", 0, 3)
    resumed_weights, resumed_state = run(tmp_path / "resumed", 3, steps)
    for a, b in zip(resumed_weights, weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert resumed_state.keys() == state.keys()
    for name, values in resumed_state.items():
        for a, b in zip(values, state[name]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)


def test_another_replica_count_keeps_what_is_owed_and_the_shared_state(tmp_path, mlp_weights):
    """powersgd from 2 replicas to 4 and to one device: each residual's sum over replicas
    (what the model is still owed) is kept, split evenly; Q, the same on every replica,
    restores exactly."""
    two = mirrored(2)
    trainer = trained(two, C.PowerSGD(rank=2), mlp_weights)
    saved = per_replica(trainer.aggregator, two)
    path = save(trainer, tmp_path)
    for strategy in (mirrored(4), tf.distribute.get_strategy()):
        restored = fresh(strategy, C.PowerSGD(rank=2), mlp_weights)
        tf.train.Checkpoint(compression=restored).restore(path).assert_consumed()
        got = per_replica(restored, strategy)
        assert got.keys() == saved.keys() and {len(v) for v in got.values()} == {strategy.num_replicas_in_sync}
        for name, values in got.items():
            if name.endswith("/q"):
                np.testing.assert_array_equal(saved[name][0], saved[name][1])
                for value in values:
                    np.testing.assert_array_equal(value, saved[name][0], err_msg=name)
            else:
                assert np.abs(saved[name][0] - saved[name][1]).max() > 0
                for value in values[1:]:
                    np.testing.assert_array_equal(value, values[0], err_msg=name)
                np.testing.assert_allclose(sum(values), sum(saved[name]), rtol=1e-5, atol=1e-7, err_msg=name)


def test_count_bound_state_is_refused_by_name_also_in_a_traced_restore():
    """THIS_COUNT state from 2 replicas under 4: refused, naming the fix; a restore traced
    in a tf.function (several tasks) decides when it runs, and rejoins a sum the same way."""
    four = mirrored(4)
    with four.scope():
        bound = replica_state.per_replica(tf.zeros([3]), "bound", replica_state.THIS_COUNT)
        owed = replica_state.per_replica(tf.zeros([3]), "owed", replica_state.SUM)
    said = []
    saved = tf.reshape(tf.range(6.0), [2, 3])
    value = replica_state.ReplicaValue(bound, "errors", lambda *counts: said.append(counts))
    with pytest.raises(C.CompressionError, match="'errors' was checkpointed with 2 replicas and means "
                                                 "nothing under 4: resume with 2 replicas, or"):
        value._restore_from_tensors({"per_replica": saved})
    assert said == [(2, 4)]

    def traced(variable):
        value = replica_state.ReplicaValue(variable, "x", lambda *_: None)
        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
        def restore(saved):
            value._restore_from_tensors({"per_replica": saved})
        return restore

    traced(owed)(saved)
    for copy in four.experimental_local_results(owed):
        np.testing.assert_allclose(copy.numpy(), [3 / 4, 5 / 4, 7 / 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match="under another replica count and means "
                                                             "nothing under 4: resume with the replica count that"):
        traced(bound)(saved)


def test_a_checkpoint_from_before_restores_the_mean_and_says_so(topk_two, tmp_path, mlp_weights, caplog):
    """A checkpoint written with the mean rule (tf.Module's own tracking: one mean per
    variable) restores that mean into every replica, and says so."""
    strategy, trainer, saved, _ = topk_two
    before = tf.Module()
    before.state = trainer.aggregator.state  # the layout those checkpoints have
    path = tf.train.Checkpoint(compression=before).save(str(tmp_path / "before"))
    assert any(n.startswith("compression/state/") for n, _ in tf.train.list_variables(path))
    restored = fresh(strategy, C.TopK(0.05), mlp_weights)
    tf.train.Checkpoint(compression=restored).restore(path).expect_partial()  # as tfpar's Checkpoints
    for name, values in per_replica(restored, strategy).items():
        for value in values:
            np.testing.assert_allclose(value, np.mean(saved[name], 0), rtol=1e-6, atol=1e-8, err_msg=name)
    assert "written before per-replica state): every replica restores that mean" in caplog.text


@pytest.mark.multiprocess
def test_two_workers_checkpoint_and_restore_their_own_state(tmp_path):
    """multi_worker_mirrored, two processes: the checkpoint gathers both workers' residuals
    (each its own row), and each worker restores its own."""
    from procs import launch

    result = launch(2, "compression_checkpoint_worker.py", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    for worker in (0, 1):
        assert (f"[worker:{worker}] CKPT worker={worker} step=3 rows=[2] own_row=True rows_differ=True "
                "restored=True") in result.stdout, result.stdout[-4000:]


def test_gathered_rows_are_every_replicas_value_in_replica_order():
    """The gather a checkpoint runs across workers, here on one worker's 2 replicas: it
    equals the rows this worker stacks itself, replica by replica."""
    strategy = mirrored(2)
    with strategy.scope():
        variable = replica_state.per_replica(tf.zeros([3]), "gathered_probe", replica_state.SUM)
    strategy.run(lambda: variable.assign(
        tf.fill([3], tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32) + 1)))
    rows = replica_state.gathered(variable)()
    np.testing.assert_array_equal(rows, replica_state.stacked(variable))
    np.testing.assert_array_equal(rows, [[1, 1, 1], [2, 2, 2]])
