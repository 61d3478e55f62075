"""The transformers: parameter counts by formula, stages, causality, masking, saving, bf16."""

import keras
import numpy as np
import pytest

from tfpar.models import GPT, EncoderClassifier, ViT


def block_params(d, mlp_ratio=4):
    attention = 2 * d + 4 * d * d + 4 * d            # LayerNorm; q, k, v, o kernels and biases
    hidden = mlp_ratio * d
    mlp = 2 * d + d * hidden + hidden + hidden * d + d  # LayerNorm; up and down Dense
    return attention + mlp


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_parameter_count_matches_the_formula(tied):
    v, n, d, depth = 256, 64, 32, 3
    model = GPT(vocab_size=v, max_len=n, dim=d, depth=depth, heads=4, tie_embeddings=tied)
    head = 2 * d + (0 if tied else d * v + v)
    assert model.count_params() == v * d + n * d + depth * block_params(d) + head


def test_encoder_and_vit_parameter_counts():
    v, n, d, c = 100, 16, 32, 3
    encoder = EncoderClassifier(vocab_size=v, max_len=n, num_classes=c, dim=d, depth=2, heads=4)
    assert encoder.count_params() == v * d + n * d + 2 * block_params(d) + 2 * d + d * c + c
    image, patch, ch = 16, 4, 3
    vit = ViT(image_size=image, patch_size=patch, channels=ch, num_classes=c, dim=d, depth=2, heads=4)
    patches = (image // patch) ** 2
    embed = patch * patch * ch * d + d + d + (patches + 1) * d   # conv kernel+bias, cls, positions
    assert vit.count_params() == embed + 2 * block_params(d) + 2 * d + d * c + c


def test_stages_are_sub_blocks_in_order_and_chain_to_the_model():
    model = GPT(vocab_size=50, max_len=12, dim=16, depth=2, heads=2)
    names = [name for name, _ in model.stages()]
    assert names == ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"]
    assert [[s.name for s in g] for g in model.stage_groups()][1] == ["blocks.0.attn", "blocks.0.mlp"]
    x = np.random.RandomState(0).randint(0, 50, (2, 12))
    h = x
    for _, layer in model.stages():
        h = layer(h)
    np.testing.assert_allclose(h, model(x), atol=1e-6)
    assert sum(layer.count_params() for _, layer in model.stages()) == model.count_params()


def test_gpt_is_causal():
    model = GPT(vocab_size=50, max_len=10, dim=16, depth=2, heads=2)
    x = np.random.RandomState(0).randint(0, 50, (1, 10))
    changed = x.copy()
    changed[0, 6] = (x[0, 6] + 1) % 50
    a, b = np.asarray(model(x)), np.asarray(model(changed))
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-4


def test_encoder_ignores_padding():
    model = EncoderClassifier(vocab_size=50, max_len=10, num_classes=3, dim=16, depth=2, heads=2)
    short = np.array([[1, 5, 9, 7]])
    padded = np.array([[1, 5, 9, 7, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_allclose(model(short), model(padded), atol=1e-5)


def test_saves_and_loads_in_keras_format(tmp_path):
    model = GPT(vocab_size=40, max_len=8, dim=16, depth=1, heads=2, tie_embeddings=True)
    path = str(tmp_path / "gpt.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)  # safe_mode: no code from the file runs
    x = np.arange(16).reshape(2, 8) % 40
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
    assert [n for n, _ in loaded.stages()] == [n for n, _ in model.stages()]


def test_bf16_mixed_precision_keeps_fp32_weights_and_logits():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = GPT(vocab_size=40, max_len=8, dim=16, depth=1, heads=2)
        logits = model(np.zeros((1, 8), "int32"))
        assert keras.backend.standardize_dtype(logits.dtype) == "float32"
        assert all(v.dtype == "float32" for v in model.trainable_variables)
        assert model.stages()[1].layer.compute_dtype == "bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny, small, base"):
        GPT.from_preset("huge")
    assert GPT.from_preset("tiny", vocab_size=256).config.dim == 128


def test_every_layer_saves_and_loads_on_its_own():
    """Each building block (registered with Keras) round-trips through Keras serialization
    with its weights: a user's own model of tfpar blocks saves like any Keras model."""
    from tfpar.models import blocks, heads

    made = [
        (blocks.TokenEmbedding(vocab_size=30, max_len=6, dim=8), np.arange(12).reshape(2, 6) % 30),
        (blocks.PatchEmbedding(image_size=8, patch_size=4, dim=8), np.ones((2, 8, 8, 3), "float32")),
        (blocks.SelfAttentionStage(dim=8, heads=2, causal=True), np.ones((2, 6, 8), "float32")),
        (blocks.FeedForwardStage(dim=8, hidden=16), np.ones((2, 6, 8), "float32")),
        (heads.LMHead(vocab_size=30), np.ones((2, 6, 8), "float32")),
        (heads.ClassifierHead(num_classes=3), np.ones((2, 6, 8), "float32")),
    ]
    for layer, x in made:
        expected = layer(x)
        copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
        copy(x)  # built
        copy.set_weights(layer.get_weights())
        np.testing.assert_allclose(copy(x), expected, atol=1e-6, err_msg=type(layer).__name__)
