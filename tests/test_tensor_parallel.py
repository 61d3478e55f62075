"""Tensor parallelism: a GPT split over T replicas equals the unsplit one (logits, loss, every
gradient, weights after training), holds 1/T of each split kernel per device, and does
Megatron's 2 all-reduces forward and 2 backward per block."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.compression import accounting
from tfpar.data.pipeline import same_batch_for_groups
from tfpar.loop import Trainer, TrainerError
from tfpar.models.blocks import FeedForwardStage
from tfpar.models.gpt import GPT
from tfpar import tensor_parallel as tp

TINY = dict(vocab_size=32, max_len=8, dim=32, depth=2, heads=4)


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def batch(rows=8):
    x = np.random.RandomState(0).randint(0, 32, size=(rows, 8)).astype("int32")
    return tf.constant(x), tf.constant(np.roll(x, -1, axis=1)), tf.ones([rows, 8])


def cross_entropy(y, logits, w):
    values = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return tf.reduce_sum(values * w) / tf.reduce_sum(w)


def split_twin(reference, replicas, degree):
    """A `degree`-way tensor-parallel GPT with `reference`'s weights, under mirrored."""
    strategy = mirrored(replicas)
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=degree)
    tp.copy_weights(reference, model)
    return strategy, model


def whole_gradients(model, per_replica, degree):
    """The replicas' gradients joined into the unsplit model's layout (TP group 0)."""
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}

    def read(weight):
        i = index[id(weight)]
        spec = tp.spec_of(weight)
        if spec is None:  # replicated: every rank of the group holds the same gradient
            for r in range(1, degree):
                np.testing.assert_allclose(per_replica[r][i], per_replica[0][i], rtol=1e-6, atol=1e-7)
            return per_replica[0][i]
        return spec.join([per_replica[r][i] for r in range(degree)])

    return tp.full_weights(model, read)


SLOW = pytest.mark.slow  # 4 replicas: the slow tier; 2 in the fast one


@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=SLOW)])
def test_logits_loss_and_every_gradient_equal_the_unsplit_model(degree):
    keras.utils.set_random_seed(0)
    reference = GPT(**TINY)
    x, y, w = batch()
    with tf.GradientTape() as tape:
        logits = reference(x)
        loss = cross_entropy(y, logits, w)
    expected = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, reference.trainable_variables)]

    strategy, model = split_twin(reference, degree, degree)

    @tf.function
    def step():
        def replica():  # every replica of the TP group sees the same batch
            with tf.GradientTape() as tape:
                out = model(x)
                value = cross_entropy(y, out, w)
            grads = tape.gradient(value, model.trainable_variables)
            return out, value, [tf.convert_to_tensor(g) for g in grads]
        return strategy.run(replica)

    outs, losses, grads = step()
    per_replica = [[g.numpy() for g in strategy.experimental_local_results(t)] for t in grads]
    per_replica = list(map(list, zip(*per_replica)))  # [replica][variable]
    for out, value in zip(strategy.experimental_local_results(outs), strategy.experimental_local_results(losses)):
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, loss, rtol=1e-5)
    got = whole_gradients(model, per_replica, degree)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def train(model, strategy, degree=1, steps=4, rows=8, **trainer):
    """AdamW with weight decay and clipping that bites, `steps` steps on one fixed batch."""
    x, y, w = batch(rows)
    groups = strategy.num_replicas_in_sync // degree
    data = tf.data.Dataset.from_tensors((x, y, w)).unbatch().batch(rows // groups).repeat()
    with strategy.scope():
        optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.01, global_clipnorm=0.5)
    run = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  strategy=strategy, steps_per_loop=2, **trainer)
    run.fit(strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree)),
            steps=steps)
    return run


@pytest.mark.parametrize("replicas,degree", [(2, 2), pytest.param(4, 4, marks=SLOW),
                                             pytest.param(4, 2, marks=SLOW)])
def test_training_with_adamw_and_clipping_equals_the_unsplit_model(replicas, degree):
    """T = all replicas (2, 4), and data x tensor parallel (2 groups of 2): 4 steps of AdamW
    with decoupled weight decay and a global-norm clip that bites, on one device and split."""
    keras.utils.set_random_seed(0)
    reference = GPT(**TINY)
    strategy, model = split_twin(reference, replicas, degree)
    train(reference, tf.distribute.get_strategy(), xla=False)
    trainer = train(model, strategy, degree)
    for got, want in zip(tp.full_weights(model), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    adam = {v.path.split("/")[-1]: v for v in trainer.optimizer.variables}
    for weight in model.trainable_variables:  # every shard's Adam moments are its own
        if tp.spec_of(weight) is not None:
            copies = [c.numpy() for _, c in tp.shards.copies(adam[f"{weight.path.replace('/', '_')}_momentum"])]
            assert not np.array_equal(copies[0], copies[1]), weight.path  # (key biases: ~1e-11, their gradient is 0)


@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=SLOW)])
def test_each_device_holds_one_tth_of_every_split_kernel(degree):
    reference = GPT(**TINY)
    _, model = split_twin(reference, degree, degree)
    for (name, layer), (_, whole) in zip(model.stages(), reference.stages()):
        if not name.startswith("blocks."):
            continue
        kernels = [w for w in layer.weights if w.path.endswith("kernel")]
        unsplit = sum(int(np.prod(w.shape)) * 4 for w in whole.weights if w.path.endswith("kernel"))
        per_device = {}
        for weight in kernels:
            assert tp.spec_of(weight) is not None, weight.path
            for _, copy in tp.shards.copies(weight):  # read from the variables on each device
                per_device[copy.device] = per_device.get(copy.device, 0) + int(np.prod(copy.shape)) * copy.dtype.size
        assert len(per_device) == degree and set(per_device.values()) == {unsplit // degree}, (name, per_device)
    held = tp.kernel_bytes_by_device(model)
    assert len(held) == degree and len(set(held.values())) == 1


def test_collectives_per_block_per_step_are_megatrons_two_forward_two_backward():
    keras.utils.set_random_seed(0)
    strategy = mirrored(2)
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=2)
    trainer = train(model, strategy, degree=2, steps=2)
    x, y, w = batch()
    data = tf.data.Dataset.from_tensors((x, y, w)).repeat()
    step = trainer.traced_step(strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, 2)))
    found = accounting.collectives(step)
    first = [c for c in found if c.device.endswith("CPU:0")]  # replica 0's
    for block in range(TINY["depth"]):
        mine = [c.name for c in first if f"block_{block}_" in c.name]
        forward = [n for n in mine if re.search(r"_g_forward/", n)]
        backward = [n for n in mine if re.search(r"_f_backward/", n)]
        assert len(forward) == 2 and len(backward) == 2 and len(mine) == 4, mine
    outside = [c for c in first if "block_" not in c.name]
    checks = [c for c in outside if accounting.in_scope(c.name, accounting.CHECK_SCOPE)]
    # checks: the whole gradient's norm (a scalar over the TP group) and the first step's
    # batch fingerprints; one batched all-reduce of the replicated weights' gradients over
    # every replica; nothing else
    assert sorted(str(c.shape) for c in checks) == ["()", "(1, 6)"], checks
    summed = [c for c in outside if c not in checks]
    assert len(summed) == 1 and "replicated_sum" in summed[0].name, summed


def test_gathered_column_and_scattered_row_layers_equal_dense_layers():
    """The other two mappings: a column-parallel layer that all-gathers its outputs and a
    row-parallel one that takes a whole input (scatter); forward and the input's gradient
    equal the dense layers', and replicated_call runs a split model from Python."""
    strategy = mirrored(2)
    x = tf.constant(np.random.RandomState(1).randn(3, 8).astype("float32"))
    with strategy.scope():
        column = tp.ColumnParallelLinear(6, degree=2, gather_output=True, bias_initializer="glorot_uniform")
        row = tp.RowParallelLinear(4, degree=2, input_is_parallel=False, bias_initializer="glorot_uniform")
        column.build((None, 8))
        row.build((None, 6))
    whole = [tp.shards.full_value(w, column.layout).numpy() for w in (column.kernel, column.bias)]
    down = tp.shards.full_value(row.kernel, row.layout).numpy()

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = row(column(x))
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, x)
        return strategy.run(replica)

    ys, grads = step()
    with tf.GradientTape() as tape:
        tape.watch(x)
        expected = (x @ whole[0] + whole[1]) @ down + row.bias.numpy()
        loss = tf.reduce_sum(expected * expected)
    expected_grad = tape.gradient(loss, x)
    for y, g in zip(strategy.experimental_local_results(ys), strategy.experimental_local_results(grads)):
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, expected_grad, rtol=1e-5, atol=1e-5)
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=2)
    plain = tp.unsplit(model)
    np.testing.assert_allclose(tp.replicated_call(model)(batch()[0]), plain(batch()[0]), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_fix():
    strategy = mirrored(2)
    with pytest.raises(tp.TensorParallelError, match="does not divide the 4 attention heads"):
        with strategy.scope():
            GPT(**{**TINY, "heads": 4}, tensor_parallel=3)
    with pytest.raises(tp.TensorParallelError, match="tensor_parallel must be a positive integer .*got 0"):
        with strategy.scope():
            GPT(**TINY, tensor_parallel=0)  # not an unsplit model in silence
    with pytest.raises(tp.TensorParallelError, match="needs 4 replicas .* but the strategy has 2"):
        with strategy.scope():
            GPT(**TINY, tensor_parallel=4)
    with pytest.raises(tp.TensorParallelError, match="does not divide the MLP width 98: use a degree that divides 98"):
        tp.check_divides(4, heads=4, hidden=98)  # GPT's width (dim x mlp_ratio) always divides: a stage's
    with pytest.raises(tp.TensorParallelError, match="does not divide the MLP width 98"):
        FeedForwardStage(dim=32, hidden=98, tensor_parallel=4)
    with strategy.scope():
        model = GPT(**TINY, tensor_parallel=2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(TrainerError, match="a compression would sum"):
        Trainer(model, keras.optimizers.SGD(0.1), loss, strategy=strategy,
                compression=tfpar.compression.TopK(0.1))
    with pytest.raises(tp.TensorParallelError, match="use global_clipnorm"):
        Trainer(model, keras.optimizers.SGD(0.1, clipnorm=1.0), loss, strategy=strategy)
    with pytest.raises(tp.TensorParallelError, match="cannot run Lamb .*whole variable.* Optimizers that train split weights: SGD, Adam, AdamW"):
        Trainer(model, keras.optimizers.Lamb(0.1), loss, strategy=strategy)
    with pytest.raises(tp.TensorParallelError, match="inside strategy.run"):
        model(batch()[0])


@pytest.mark.multiprocess
def test_data_x_tensor_parallel_across_four_worker_processes_equals_one_device(tmp_path):
    """4 workers of one replica each, T = 2: the tensor-parallel groups {0, 1}, {2, 3} and the
    data-parallel groups {0, 2}, {1, 3} all span processes (their own collective group keys,
    agreed by order). After 4 steps of AdamW with a clip every worker holds the one-device
    weights."""
    from procs import launch
    from scripts import tensor_parallel_worker as worker

    keras.utils.set_random_seed(0)
    reference = GPT(**worker.TINY)
    initial = reference.get_weights()
    np.savez(tmp_path / "init.npz", **{f"w{i}": w for i, w in enumerate(initial)})
    result = launch(4, "tensor_parallel_worker.py", str(tmp_path / "init.npz"), str(tmp_path), "2", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "TP groups [[0, 1], [2, 3]]" in result.stdout
    Trainer(reference, worker.optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_loop=2, xla=False).fit(tf.data.Dataset.from_tensors(worker.batch()).repeat(), worker.STEPS)
    for task in range(4):
        saved = np.load(tmp_path / f"weights_{task}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert len(got) == len(initial)
        for a, b in zip(got, reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"worker {task}")
