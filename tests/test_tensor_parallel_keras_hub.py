"""keras-hub backbones split by a layout map (their own `get_layout_map`: Llama, Gemma; tfpar's
for GPT2) under `tfpar.distribution.enable()`: logits, loss, every gradient and the weights
after 4 steps of AdamW with a clip equal the unsplit model on one device; each device holds
1/T of every split kernel; the all-reduces per block are counted from the traced step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

keras_hub = pytest.importorskip("keras_hub")

import tfpar  # noqa: E402
from tfpar import tensor_parallel as tp  # noqa: E402
from tfpar.compression import accounting  # noqa: E402
from tfpar.models.layout_maps import layout_map_for, llama_megatron  # noqa: E402

CONFIGS = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                                     num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                                     max_sequence_length=16)),
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                                     num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                                     head_dim=8)),
    "gpt2": ("GPT2Backbone", "GPT2CausalLM", dict(vocabulary_size=64, num_layers=2, num_heads=4, hidden_dim=32,
                                                  intermediate_dim=64, max_sequence_length=16, dropout=0.0)),
}
CONFIGS["llama_megatron"] = CONFIGS["llama"]  # the same model, split by tfpar's Megatron map for Llama
MAPS = {"llama_megatron": llama_megatron}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def enabled():
    tfpar.distribution.enable()
    yield
    keras.distribution.set_distribution(None)
    tfpar.distribution.disable()  # Keras's own functions back for the worker's next module


def causal_lm(name):
    backbone, lm, config = CONFIGS[name]
    keras.utils.set_random_seed(0)
    return getattr(keras_hub.models, lm)(backbone=getattr(keras_hub.models, backbone)(**config), preprocessor=None)


def adamw():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.01, global_clipnorm=0.5, epsilon=1e-3)


def batches(count=4, rows=8):
    ids = np.random.RandomState(0).randint(0, 64, size=(count * rows, 17)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((count * rows, 16), "int32")}
    return tf.data.Dataset.from_tensor_slices((x, ids[:, 1:], np.ones((count * rows, 16), "float32"))).batch(rows)


def model_parallel(name, devices, model_axis):
    mesh = keras.distribution.DeviceMesh((devices // model_axis, model_axis), ["batch", "model"],
                                         keras.distribution.list_devices()[:devices])
    layout_map = MAPS[name](mesh) if name in MAPS else layout_map_for(CONFIGS[name][0], mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def split(name, devices, model_axis):
    keras.distribution.set_distribution(model_parallel(name, devices, model_axis))
    model = causal_lm(name)
    assert tp.layout_of(model).degree == model_axis
    return model


def assert_close(actual, expected, tol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,devices,model_axis", [
    ("llama", 2, 2), pytest.param("llama", 4, 2, marks=pytest.mark.slow), ("llama_megatron", 2, 2),
    pytest.param("llama", 4, 4, marks=pytest.mark.slow),
    pytest.param("gemma", 4, 2, marks=pytest.mark.slow), pytest.param("gpt2", 2, 2, marks=pytest.mark.slow)])
def test_logits_loss_and_every_gradient_equal_the_unsplit_model(name, devices, model_axis):
    x, y, w = next(iter(batches(1)))
    reference = causal_lm(name)
    with tf.GradientTape() as tape:
        logits = reference(x)
        loss = LOSS(y, logits, w)
    expected = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, reference.trainable_variables)]
    model = split(name, devices, model_axis)
    strategy = model.distribute_strategy
    assert_close(model.get_weights(), reference.get_weights(), tol=0.0)  # the same initial weights

    @tf.function
    def step():
        def replica():  # every replica the whole batch: each rank's gradient is the whole model's
            with tf.GradientTape() as tape:
                out = model(x)
                value = LOSS(y, out, w) * strategy.num_replicas_in_sync  # Keras's loss divides by N
            return out, value, [tf.convert_to_tensor(g) for g in tape.gradient(value, model.trainable_variables)]
        return strategy.run(replica)

    outs, values, grads = step()
    for out, value in zip(strategy.experimental_local_results(outs), strategy.experimental_local_results(values)):
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, loss, rtol=1e-5)
    degree = tp.layout_of(model).degree
    for variable, want, per_replica in zip(model.trainable_variables, expected, grads):
        copies = [g.numpy() for g in strategy.experimental_local_results(per_replica)]
        spec = tp.spec_of(variable)
        got = spec.join(copies[:degree]) if spec else copies[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=variable.path)


def test_two_split_models_of_one_class_each_read_their_own_head_counts():
    """Each attention layer keeps its own split (their class is shared): a second split
    Gemma (its map splits the heads; it reshapes by their count), on a 2 x 2 mesh after a
    1 x 2 one, reads its own head counts in its replicas."""
    x, _, _ = next(iter(batches(1)))
    logits = causal_lm("gemma")(x)
    for devices in (2, 4):
        model = split("gemma", devices, 2)
        strategy = model.distribute_strategy
        outs = tf.function(lambda: strategy.run(lambda: model(x)))()  # noqa: B023  (called at once)
        for out in strategy.experimental_local_results(outs):
            np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-5)


def one_device_weights(name):
    """4 steps of AdamW with a clip on one device (Keras fit, tfpar's Keras fixes applied:
    the fixture's enable() applies them, so the one-device reference sums sparse rows)."""
    model = causal_lm(name)
    model.compile(optimizer=adamw(), loss=LOSS, weighted_metrics=[])
    model.fit(batches(), epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


@pytest.mark.slow  # each trains an unsplit and a split model: 10-20 s
@pytest.mark.parametrize("name,devices,model_axis,how", [
    ("llama", 2, 2, "fit"), ("llama", 4, 2, "trainer"), ("llama", 4, 4, "fit"), ("gemma", 4, 2, "fit"),
    ("gpt2", 2, 2, "trainer")])
def test_four_adamw_steps_with_a_clip_equal_the_unsplit_model(name, devices, model_axis, how):
    expected = one_device_weights(name)
    model = split(name, devices, model_axis)
    if how == "fit":
        model.compile(optimizer=adamw(), loss=LOSS, weighted_metrics=[])
        model.fit(batches(), epochs=1, verbose=0, shuffle=False)
    else:
        trainer = tfpar.Trainer(model, adamw(), LOSS)  # the model's strategy, a plain dataset
        # keras-hub's maps lay the kernels on "batch" too: ZeRO-2 over the data-parallel replicas
        assert (trainer._sharded is not None) == (devices > model_axis)
        trainer.fit(batches(), steps=4)
    moved = max(np.abs(a - b).max() for a, b in zip(expected, causal_lm(name).get_weights()))
    assert moved > 1e-3
    assert_close(model.get_weights(), expected)


@pytest.mark.parametrize("name,forward_backward", [("llama", (5, 1)), ("llama_megatron", (2, 2))])
def test_each_device_holds_one_tth_of_every_split_kernel_and_the_collectives_per_block(name, forward_backward):
    """Llama's own map splits Q, K, V and the output projection along their input features
    (row-parallel: the input scattered, the products summed) and the MLP as Megatron does:
    per block 5 all-reduces forward (Q, K, V, the output, the MLP's second layer) and 1
    backward (the MLP's f). tfpar's Megatron map splits attention by heads: 2 forward (the
    g's of attention and MLP) and 2 backward (their f's, one per input however many layers
    read it). 1/T of every split kernel on each device."""
    model = split(name, 2, 2)
    unsplit = {w.path: int(np.prod(tp.whole_shape(w))) * 4 for w in model.weights if tp.spec_of(w) is not None}
    for weight in model.weights:
        if tp.spec_of(weight) is not None:
            held = [int(np.prod(copy.shape)) * copy.dtype.size for _, copy in tp.shards.copies(weight)]
            assert held == [unsplit[weight.path] // 2] * 2, weight.path
    trainer = tfpar.Trainer(model, adamw(), LOSS)
    found = accounting.collectives(trainer.traced_step(batches()))
    mine = [c.name for c in found if c.device.endswith("CPU:0") and c.type == "CollectiveReduceV2"
            and "transformer_layer_0/" in c.name]
    forward = [n for n in mine if "_g_forward/" in n]
    backward = [n for n in mine if "_f_backward/" in n]
    assert (len(forward), len(backward), len(mine)) == (*forward_backward, sum(forward_backward)), mine
