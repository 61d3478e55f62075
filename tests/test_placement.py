"""Layer placement: plans, and pipelines whose loss and gradients equal the unsplit model's."""

import numpy as np
import pytest
import tensorflow as tf

from tfpar import placement
from tfpar.models.gpt import GPT

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def small_gpt():
    return GPT(vocab_size=32, max_len=8, dim=32, depth=2, heads=2)


def batch():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 32, size=(8, 8)).astype("int32")
    return tf.constant(x), tf.constant(np.roll(x, -1, axis=1)), tf.ones([8, 8])


def share(y, logits, w):
    """Cross-entropy summed over a micro-batch, divided by the whole batch's targets (64)."""
    values = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return tf.reduce_sum(values * w) / 64.0


def test_manual_plans_parse_ranges_and_refuse_mistakes():
    model = small_gpt()
    plan = placement.manual(model, {"embed,blocks.0.attn-blocks.0.mlp": "/cpu:0",
                                    "blocks.1.attn-head": "/cpu:1"})
    assert [g.names for g in plan.groups] == [("embed", "blocks.0.attn", "blocks.0.mlp"),
                                             ("blocks.1.attn", "blocks.1.mlp", "head")]
    assert sum(g.params for g in plan.groups) == model.count_params()
    assert "blocks.1.attn .. head" in plan.table() and "/cpu:1" in plan.table()
    with pytest.raises(placement.PlacementError, match="Unknown stage 'blocks.9.mlp'"):
        placement.manual(model, {"embed-blocks.9.mlp": "/cpu:0"})
    with pytest.raises(placement.PlacementError, match="Missing: head"):
        placement.manual(model, {"embed-blocks.1.mlp": "/cpu:0"})


def test_balanced_plan_minimises_the_largest_group():
    model = GPT(vocab_size=256, max_len=128, dim=128, depth=2, heads=4)  # gpt_tiny's shapes
    two = placement.balanced(model, DEVICES[:2])
    assert len(two.groups) == 2 and two.largest_share() <= 0.55
    four = placement.balanced(model, DEVICES)
    best = max(placement.stage_params(model), key=lambda s: s[1])[1] / model.count_params()
    assert four.largest_share() >= best - 1e-9 and four.largest_share() < 0.5
    # brute force over every 2-way cut agrees
    params = [p for _, p in placement.stage_params(model)]
    brute = min(max(sum(params[:i]), sum(params[i:])) for i in range(1, len(params)))
    assert max(g.params for g in two.groups) == brute


@pytest.mark.parametrize("schedule,micro_batches,remat,stages", [
    ("naive", 1, False, 2), ("gpipe", 1, False, 2), ("gpipe", 4, False, 2), ("1f1b", 4, False, 2),
    ("1f1b", 2, False, 4), ("gpipe", 8, False, 4), ("1f1b", 4, True, 2), ("gpipe", 2, True, 4)])
def test_pipeline_loss_and_gradients_equal_the_unsplit_model(schedule, micro_batches, remat, stages):
    reference = small_gpt()
    x, y, w = batch()
    with tf.GradientTape() as tape:
        loss = share(y, reference(x), w)
    expected = tape.gradient(loss, reference.trainable_variables)

    plan = placement.balanced(reference, DEVICES[:stages])
    with plan.scope():
        model = small_gpt()
    model.set_weights(reference.get_weights())
    pipe = placement.Pipeline(model, plan, micro_batches=micro_batches, schedule=schedule,
                              remat=remat, record=True)
    got_loss, grads = tf.function(lambda: pipe.forward_backward(x, y, w, share))()
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(e), rtol=1e-5, atol=1e-5)


def test_schedule_orders():
    assert placement.schedule_order("1f1b", 2, 4) == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]]
    gpipe = placement.schedule_order("gpipe", 2, 2)[0]
    assert gpipe == [("F", 0), ("F", 1), ("B", 1), ("B", 0)]


def test_trainer_with_a_pipeline_trains_like_the_unsplit_model(tmp_path):
    import keras

    from tfpar.loop import Trainer

    x, y, w = batch()
    dataset = tf.data.Dataset.from_tensors((x, y, w)).repeat()
    keras.utils.set_random_seed(0)
    reference = small_gpt()
    initial = reference.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # SGD: Keras's Adam squares a sparse (embedding) gradient per slice, before duplicate
    # rows are summed, while the pipeline's gradients are dense; SGD is the same either way.
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    Trainer(reference, sgd(), loss, steps_per_loop=2).fit(dataset, steps=4)

    plan = placement.balanced(reference, DEVICES[:2])
    with plan.scope():
        model = small_gpt()
    model.set_weights(initial)
    pipe = placement.Pipeline(model, plan, micro_batches=4, schedule="1f1b", record=True)
    trainer = Trainer(model, sgd(), loss, placement=pipe, steps_per_loop=2)
    trainer.fit(dataset, steps=4)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    def index(device):
        return tf.DeviceSpec.from_string(device).device_index

    momentum = {m.path.split("/")[-1]: m for m in trainer.optimizer.variables}
    for v in model.trainable_variables:  # variables and optimizer slots on their stage's device
        stage = next(name for name, layer in model.stages() if any(v is lv for lv in layer.weights))
        slot = momentum[v.path.replace("/", "_") + "_momentum"]
        assert index(v.value.device) == index(slot.value.device) == index(plan.device_of(stage)), v.path

    # one recorded step: 2 stages x 4 micro-batches x (forward, backward), drawn
    timings = tf.function(lambda: (pipe.forward_backward(x, y, w, share), pipe.timings)[1])().numpy()
    assert timings.shape == (16, 5) and np.all(timings[:, 4] >= timings[:, 3])
    summary = placement.timeline.draw(timings, str(tmp_path / "gantt.png"), gif=str(tmp_path / "p.gif"))
    assert 0 <= summary["bubble"] < 1 and summary["bubble_theory"] == pytest.approx(1 / 5)
    assert (tmp_path / "gantt.png").stat().st_size > 1000 and (tmp_path / "p.gif").stat().st_size > 1000
