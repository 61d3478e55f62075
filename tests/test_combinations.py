"""Features that meet: each combination a user makes equals its reference or is refused.

Each test here failed before its fix (the numbers in the docstrings are the old ones):
Keras's optimizer options under several replicas, compressors under mixed_float16, the
config path of the compressors that compute the step, 1-bit momentum on entries without
variance, and what clipping means for each compressor. tests/test_matrix.py covers every
pair of options; these pin the findings down exactly.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from test_compression import mirrored, mlp, mlp_data
from tfpar import compression as C
from tfpar.loop import Trainer

OPTIONS = {  # Keras optimizer options a user passes to compile
    "global_clipnorm": dict(global_clipnorm=0.1),
    "clipnorm": dict(clipnorm=0.05),
    "clipvalue": dict(clipvalue=0.01),
    "accumulation": dict(gradient_accumulation_steps=2),
    "ema": dict(use_ema=True, ema_overwrite_frequency=3),
}


def crossentropy():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def gap(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def fit(strategy, weights, optimizer):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(weights)
        model.compile(optimizer=optimizer(), loss=crossentropy(), steps_per_execution=2)
    model.fit(fit_model.dataset(), epochs=1, steps_per_epoch=fit_model.STEPS, verbose=0, shuffle=False)
    return model.get_weights()


def loop(strategy, weights, optimizer):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(weights)
        built = optimizer()
    trainer = Trainer(model, built, crossentropy(), strategy=strategy, steps_per_loop=2)
    trainer.fit(strategy.experimental_distribute_dataset(fit_model.dataset()), steps=fit_model.STEPS)
    return model.get_weights()


@pytest.mark.parametrize("option", list(OPTIONS))
def test_keras_optimizer_options_under_two_replicas_equal_one_device(option):
    """fit and the loop on 2 replicas against fit on one device, an embedding model (sparse
    gradients), SGD with momentum: within 1e-5. Before: global_clipnorm 1.4e-1 off, clipnorm
    1.6e-1, clipvalue 1.9e-1 (Keras clipped each replica's share, and an embedding's rows
    apart), accumulation and EMA crashed ("merge_call called while defining a new graph")."""
    weights = fit_model.initial_weights()
    optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9, **OPTIONS[option])  # noqa: E731
    reference = fit(tfpar.create_strategy("default"), weights, optimizer)
    assert gap(reference, weights) > 1e-3
    strategy = mirrored(2)
    assert gap(fit(strategy, weights, optimizer), reference) < 1e-5
    assert gap(loop(strategy, weights, optimizer), reference) < 1e-5


def test_an_embeddings_clip_norm_counts_a_repeated_row_once():
    """One device: Keras clipped an embedding's gradient by the norm of its per-token slices
    (7.49 here), not of the gradient (10.20); the clipped step is now the dense one's."""
    weights = fit_model.initial_weights()
    x, y = next(iter(fit_model.dataset()))
    model = fit_model.build_model()
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(crossentropy()(y, model(x)))
    dense = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_weights)]
    clipped, norm = tf.clip_by_global_norm(dense, 0.1)
    expected = [w - 0.1 * g.numpy() for w, g in zip(weights, clipped)]
    got = fit_model_one_step(weights, keras.optimizers.SGD(0.1, global_clipnorm=0.1))
    assert float(norm) > 10 and gap(got, expected) < 1e-6


def fit_model_one_step(weights, optimizer):
    tfpar.create_strategy("default")  # the Keras fixes
    model = fit_model.build_model()
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss=crossentropy())
    model.fit(fit_model.dataset(), epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    return model.get_weights()


# -- compressors under mixed_float16 --------------------------------------------------------

def first_updates(compression, optimizer, precision, steps=3, strategy=None, mode="loop"):
    """The MLP's weights moved by `steps` steps on 2 replicas in `precision`."""
    strategy = strategy or mirrored(2)
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(precision)
    try:
        with strategy.scope():
            model = mlp()
            start = model.get_weights()
            built = optimizer()
            if precision == "mixed_float16":
                built = keras.optimizers.LossScaleOptimizer(built)
            if mode == "fit":
                model.compile(optimizer=built, loss=crossentropy())
                C.compress_fit(model, compression())
        if mode == "fit":
            model.fit(mlp_data(steps=steps), epochs=1, verbose=0, shuffle=False)
        else:
            trainer = Trainer(model, built, crossentropy(), strategy=strategy, compression=compression())
            trainer.fit(strategy.experimental_distribute_dataset(mlp_data(steps=steps)), steps=steps)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return np.concatenate([(w - s).ravel() for w, s in zip(model.get_weights(), start)])


ADAM = lambda: keras.optimizers.AdamW(0.01, weight_decay=0.0, global_clipnorm=0.5)  # noqa: E731
CARRIERS = {  # compressors that keep Adam's moments, clip, or error feedback in gradient units
    "onebit_adam": (lambda: C.OneBitAdam(freeze_step=1, policy=C.Policy(min_size=0, skip=())), ADAM),
    "dgc_adam": (lambda: C.DGCAdam(ratio=0.1, freeze_step=1, policy=C.Policy(min_size=0, skip=())), ADAM),
    "dgc": (lambda: C.Compression(C.DGC(ratio=0.1), C.Policy(min_size=0)),
            lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5)),
    "topk": (lambda: C.Compression(C.TopK(0.1), C.Policy(min_size=0)),
             lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5)),
}


def assert_moves_as_in_float32(compression, optimizer, mode="loop"):
    """The first step (Adam's warm-up, or the compressed step) within 3% of float32: fp16's
    forward pass rounds to 2^-11, and the first updates measured 1.2-1.9% apart (entries whose
    gradient is near zero). Three steps (the compressed phase from step 2) move the weights
    by a total within 2x of float32's: a frozen variance amplifies rounding there (its
    norm ratio measured 1.07 for 1-bit Adam, 1.54 for dgc_adam), while a loss-scale bug is
    a factor of 2^15."""
    one = [first_updates(compression, optimizer, p, steps=1, mode=mode) for p in ("float32", "mixed_float16")]
    assert np.linalg.norm(one[1] - one[0]) < 0.03 * np.linalg.norm(one[0])
    three = [first_updates(compression, optimizer, p, steps=3, mode=mode) for p in ("float32", "mixed_float16")]
    assert 0.5 < np.linalg.norm(three[1]) / np.linalg.norm(three[0]) < 2.0


@pytest.mark.parametrize("name", list(CARRIERS))
def test_compressors_under_fp16_move_the_weights_as_in_float32(name):
    """2 replicas. Before: 1-bit Adam and dgc_adam moved 32,768x too little (their Adam step
    does not depend on the loss scale, which the LossScaleOptimizer then divided out) and
    dgc clipped the loss-scaled gradients."""
    assert_moves_as_in_float32(*CARRIERS[name])


def test_compress_fit_under_fp16_moves_the_weights_as_in_float32():
    """Keras fit with dgc (its SGD's clip moved in) under a LossScaleOptimizer."""
    assert_moves_as_in_float32(*CARRIERS["dgc"], mode="fit")


# -- 1-bit momentum where the variance is zero -----------------------------------------------

def test_one_bit_momentum_leaves_an_unused_embedding_row_where_it_was():
    """Rows 40-63 of a compressed embedding are never looked up: their frozen variance is 0,
    and 1 bit cannot send 0. Before the mask they moved about scale / epsilon every step
    (1e3 against 0.1 for used entries); now they stay exactly where they were."""
    strategy = mirrored(2)
    with strategy.scope():
        inputs = keras.Input((6,), dtype="int32")
        x = keras.layers.Embedding(64, 32, name="embedding")(inputs)
        outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x))
        model = keras.Model(inputs, outputs)
        start = model.get_weights()
        optimizer = keras.optimizers.Adam(0.01)
    onebit = C.OneBitAdam(freeze_step=2, policy=C.Policy(min_size=0, skip=()))
    trainer = Trainer(model, optimizer, crossentropy(), strategy=strategy, compression=onebit)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 40, size=(96, 6)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((tokens, tokens[:, 0] % 4)).batch(16)
    trainer.fit(strategy.experimental_distribute_dataset(data), steps=6)
    table, before = model.get_weights()[0], start[0]
    np.testing.assert_array_equal(table[40:], before[40:])
    assert np.abs(table[:40] - before[:40]).max() > 1e-3  # the used rows trained


# -- what clipping means ---------------------------------------------------------------------

def test_after_the_freeze_the_tensors_left_dense_are_clipped_too():
    """1-bit Adam after its freeze: the policy leaves the biases (and small tensors) dense;
    the clip's factor covers them (before: only the compressed tensors were clipped, each
    replica on its own R g). With clip 1e-3 they end elsewhere than without clip."""
    def run(clip):
        policy = C.Policy(min_size=1000)
        optimizer = lambda: keras.optimizers.Adam(0.01, global_clipnorm=clip)  # noqa: E731
        return first_updates(lambda: C.OneBitAdam(freeze_step=1, policy=policy), optimizer, "float32")
    sizes = [w.size for w in mlp().get_weights()]
    dense = np.concatenate([np.ones(n, bool) if n < 1000 else np.zeros(n, bool) for n in sizes])
    clipped, free = run(1e-3), run(None)
    assert np.abs(clipped[dense] - free[dense]).max() > 1e-4


# -- the config path --------------------------------------------------------------------------

def test_the_binary_gives_onebit_adam_the_configs_adamw():
    """`--config.compression=onebit_adam` with the default AdamW (weight decay 0.01, beta_2
    0.98, clip_norm 1.0): 1-bit Adam gets those betas and that clip, an SGD applies its step
    with the same schedule and weight decay. Before: the config needed
    `--config.optimizer.name=sgd --config.optimizer.momentum=0 --config.optimizer.clip_norm=0`,
    and weight decay became 0, beta_2 0.999 and clipping off."""
    import runpy

    from tfpar import run as run_lib
    from tfpar.config import ConfigError, validate

    config = runpy.run_path("configs/reverse_tiny.py")["get_config"]()
    config.mode, config.compression = "loop", "onebit_adam"
    config.train.steps = 2
    validate(config)
    run = run_lib.setup(config, "/tmp/unused")
    run_lib.build(run)
    onebit, sgd = run.trainer.aggregator, run.trainer.optimizer
    assert (onebit.beta_1, onebit.beta_2, onebit.epsilon, onebit.clip_norm) == (0.9, 0.98, 1e-7, 1.0)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == 0 and sgd.weight_decay == 0.01
    assert run.optimizer is sgd and run.model.optimizer.name != sgd.name  # checkpointed: the one that steps
    schedule = run.model.optimizer._learning_rate  # pylint: disable=protected-access
    assert sgd._learning_rate.get_config() == schedule.get_config()  # pylint: disable=protected-access
    config.optimizer.name = "sgd"
    with pytest.raises(ConfigError, match="onebit_adam computes AdamW's step.*--config.optimizer.name=adamw"):
        validate(config)


# -- compression meets Keras's own options ---------------------------------------------------

def test_compress_fit_on_one_device_sends_through_the_compressor():
    """One device: fit with TopK(0.05) is the loop with TopK(0.05), not uncompressed fit (the
    update fix had made the one-device all-reduce an identity around compress_fit's hook)."""
    def fit_topk(compression):
        keras.utils.set_random_seed(0)
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=crossentropy())
        if compression:
            C.compress_fit(model, C.Compression(C.TopK(0.05), C.Policy(min_size=0)))
        model.fit(mlp_data(steps=3), epochs=1, verbose=0, shuffle=False)
        return model.get_weights()

    tfpar.create_strategy("default")
    keras.utils.set_random_seed(0)
    model = mlp()
    trainer = Trainer(model, keras.optimizers.SGD(0.1), crossentropy(),
                      compression=C.Compression(C.TopK(0.05), C.Policy(min_size=0)))
    trainer.fit(mlp_data(steps=3), steps=3)
    compressed = fit_topk(True)
    assert gap(compressed, model.get_weights()) < 1e-6
    assert gap(compressed, fit_topk(False)) > 1e-3


@pytest.mark.parametrize("compressor", ["topk", "int8", "sign", "powersgd"])
def test_keras_accumulation_with_a_lossy_compressor_is_refused_by_name(compressor):
    """Keras's gradient_accumulation_steps would compress each micro-batch on its own (topk:
    1.15e-2 away from one 2x batch): refused in the loop and in compress_fit, naming
    Trainer(accumulate=K). A plain sum in 16 bits (fp16) is allowed."""
    optimizer = lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)  # noqa: E731
    with pytest.raises(C.CompressionError, match=f"{compressor}.*gradient_accumulation_steps.*accumulate=K"):
        Trainer(mlp(), optimizer(), crossentropy(), compression=C.get(compressor))
    model = mlp()
    model.compile(optimizer=optimizer(), loss=crossentropy())
    with pytest.raises(C.CompressionError, match="micro-batch on its own"):
        C.compress_fit(model, C.get(compressor))
    Trainer(mlp(), optimizer(), crossentropy(), compression=C.FP16())
