"""Interleaved and zero-bubble pipeline schedules, selective recompute, activation memory,
stages on TPU logical cores: each against the unsplit model's numbers."""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

from tfpar import placement
from tfpar.models.gpt import GPT
from tfpar.placement import schedules, tpu_cores

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def gpt(depth=3):
    """8 stages at depth 3: enough for 4 devices x 2 chunks."""
    return GPT(vocab_size=32, max_len=8, dim=32, depth=depth, heads=2)


def batch():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 32, size=(8, 8)).astype("int32")
    return tf.constant(x), tf.constant(np.roll(x, -1, axis=1)), tf.ones([8, 8])


def share(y, logits, w):
    values = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return tf.reduce_sum(values * w) / 64.0


@functools.lru_cache(maxsize=1)
def reference():
    """One model shared by the tests (never trained) and its loss and gradients."""
    model = gpt()
    x, y, w = batch()
    with tf.GradientTape() as tape:
        loss = share(y, model(x), w)
    return model, loss, tape.gradient(loss, model.trainable_variables)


def run(schedule, stages, micro_batches, remat=False, record=False, unit_times=None):
    model, _, _ = reference()
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    plan = placement.balanced(model, DEVICES[:stages], chunks=chunks,
                              layout="v" if schedule == "zb-v" else "round_robin")
    pipe = placement.Pipeline(model, plan, micro_batches=micro_batches, schedule=schedule,
                              remat=remat, record=record, unit_times=unit_times)
    x, y, w = batch()

    @tf.function
    def step():  # the timings are a tensor of the traced step: returned with it
        loss, grads = pipe.forward_backward(x, y, w, share)
        return loss, grads, pipe.timings if record else tf.zeros([0, 6], tf.float64)

    loss, grads, timings = step()
    return pipe, loss, grads, timings.numpy()


def assert_like_unsplit(loss, grads):
    _, expected_loss, expected = reference()
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(e), rtol=1e-5, atol=1e-5)


def test_orders_run_every_unit_once_and_meet_their_theory():
    for stages in (2, 4):
        for m in (1, 2, 4, 8):
            assert schedules.bubble_theory("1f1b", stages, stages, m) == pytest.approx((stages - 1) / (m + stages - 1))
            zb = schedules.bubble_theory("zb-h1", stages, stages, m)
            assert zb < schedules.bubble_theory("1f1b", stages, stages, m)
            orders = schedules.order("zb-h1", stages, stages, m)
            assert [sorted(o) for o in orders] == [sorted((k, d, i) for k in "FBW" for i in range(m))
                                                   for d in range(stages)]
            if m % stages == 0:
                theory = schedules.bubble_theory("interleaved", stages, 2 * stages, m)
                assert theory == pytest.approx((stages - 1) / (2 * m + stages - 1))
    # zb-h1 reaches the paper's (S-1)(F+B-W) bubble, (S-1)/(3M+S-1) at F=B=W, holding no more
    # than 1F1B's device 0 (S micro-batches); the greedy alone stopped at 0.172 for S=4, M=8
    for stages, m in ((2, 8), (3, 6), (4, 8), (4, 16)):
        assert schedules.bubble_theory("zb-h1", stages, stages, m) == pytest.approx((stages - 1) / (3 * m + stages - 1))
        assert max(schedules.held(schedules.order("zb-h1", stages, stages, m))) <= stages
    assert schedules.order("interleaved", 2, 4, 2)[1] == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1), ("B", 1, 0), ("B", 1, 1)]
    # at most S - d micro-batches forwarded ahead of their B on device d, as 1F1B
    for d, order in enumerate(schedules.order("zb-h1", 4, 4, 8)):
        ahead = [sum(k == "F" for k, _, _ in order[:i + 1]) - sum(k == "B" for k, _, _ in order[:i + 1])
                 for i in range(len(order))]
        assert max(ahead) <= 4 - d


# unit times as this CPU measured them while the first group's B was empty (its W did it all)
MEASURED = {("F", 0): 1.0, ("B", 0): 0.0, ("W", 0): 1.0, ("F", 1): 1.0, ("B", 1): 0.4, ("W", 1): 0.6}


def test_zb_h1_orders_for_the_unit_times_it_is_given():
    def replayed(order, split=True):
        return schedules.bubble(schedules.simulate(order, 2, MEASURED, split_backward=split), 2)

    for m in (4, 8):
        profiled = schedules.order("zb-h1", 2, 2, m, MEASURED)
        assert [sorted(o) for o in profiled] == [sorted((k, d, i) for k in "FBW" for i in range(m))
                                                 for d in range(2)]
        for d, order in enumerate(profiled):  # the memory of 1F1B's device 0 at most
            held = [sum(k == "F" for k, _, _ in order[:i + 1]) - sum(k == "W" for k, _, _ in order[:i + 1])
                    for i in range(len(order))]
            assert max(held) <= 2
        # device 1 waits for one forward, then is never idle: the least any order can do
        assert replayed(profiled) == pytest.approx(1 - 2 * m * 2.0 / (2 * (1.0 + m * 2.0)))
        assert replayed(profiled) < replayed(schedules.order("zb-h1", 2, 2, m))  # the F=B=W order
    assert replayed(profiled) < 0.55 * replayed(schedules.order("1f1b", 2, 2, 8), split=False)
    assert schedules.order("zb-h1", 2, 2, 8, schedules.NOMINAL) == schedules.order("zb-h1", 2, 2, 8)


# unit times measured at S = 4 (deep-wide GPT, benchmarks/results/schedules): device 0's W
# three times its F, no B (the embedding has no input gradient)
MEASURED_S4 = {("F", 0): 0.167, ("F", 1): 0.200, ("F", 2): 0.183, ("F", 3): 0.205,
               ("B", 0): 0.0, ("B", 1): 0.241, ("B", 2): 0.236, ("B", 3): 0.211,
               ("W", 0): 0.607, ("W", 1): 0.375, ("W", 2): 0.377, ("W", 3): 0.327}


@pytest.mark.parametrize("schedule,groups", [("zb-h1", 4), ("zb-v", 8)])
def test_a_profiled_order_never_replays_longer_than_the_equal_times_order(schedule, groups):
    # the greedy list schedule alone gave zb-h1 at M = 4 a replayed bubble of 0.258 at these
    # times, where the order built for equal times replays at 0.192
    def replayed(order):
        return schedules.bubble(schedules.simulate(order, groups, MEASURED_S4, split_backward=True), 4)

    for m in (4, 8):
        profiled = schedules.order(schedule, 4, groups, m, MEASURED_S4)
        equal = schedules.order(schedule, 4, groups, m)
        assert replayed(profiled) <= replayed(equal) + 1e-9, m
        assert max(schedules.held(profiled)) <= max(schedules.held(equal)), m  # no more memory


FAST = {("zb-h1", 2, 4), ("interleaved", 2, 4), ("zb-h1", 4, 2)}
CASES = [(s, n, m) for s in ("gpipe", "1f1b", "interleaved", "zb-h1") for n in (2, 4) for m in (1, 2, 4, 8)
         if s != "interleaved" or m % n == 0]


@pytest.mark.parametrize("schedule,stages,micro_batches", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_each_schedule_equals_the_unsplit_model(schedule, stages, micro_batches, request):
    if (schedule, stages, micro_batches) not in FAST:  # numbers only: the fast cases keep grappler
        request.getfixturevalue("without_grappler")
    profiled = (schedule, stages) == ("zb-h1", 2) and micro_batches % 2 == 0  # the others: F=B=W
    pipe, loss, grads, timings = run(schedule, stages, micro_batches, record=True,
                                     unit_times=MEASURED if profiled else None)
    assert_like_unsplit(loss, grads)
    units_per_mb = len(pipe.groups) * (3 if schedule == "zb-h1" else 2)
    assert timings.shape == (units_per_mb * micro_batches, 6)
    for d, order in enumerate(pipe.order):  # each device runs its units in order, one at a time
        mine = {(int(g), int(m), int(k)): (a, b) for dev, m, k, a, b, g in timings if dev == d}
        spans = [mine[(g, m, placement.pipeline.KIND[kind])] for kind, g, m in order]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), d


def test_the_first_groups_backward_splits_into_its_activation_chain_and_its_weight_gradients():
    """The first group's input (token ids) has no gradient; its B is the activation chain back
    to the embedding's output, its W the weight gradients, the embedding's among them."""
    pipe = run("zb-h1", 2, 2)[0]
    ops = pipe.unit_op_types()
    products = {"MatMul", "BatchMatMulV2", "Einsum"}
    for m in range(2):
        b, w = ops[("B", 0, m)], ops[("W", 0, m)]
        assert sum(t in products for t in b) >= 10, b  # dY W^T through three sublayers
        assert sum(t in products for t in w) >= 10, w  # X^T dY of each kernel
        assert "UnsortedSegmentSum" in w and "UnsortedSegmentSum" not in b  # the embedding's gradient


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.slow), "zb-h1"])
def test_selective_recompute_keeps_the_numbers_and_saves_the_attention_core(schedule):
    saved = {}
    for remat in ([False, "attention", True] if schedule == "1f1b" else [False, "attention"]):
        pipe, loss, grads, _ = run(schedule, 2, 2, remat=remat)
        assert_like_unsplit(loss, grads)
        saved[remat] = sum(v for k, v in pipe.activation_bytes.items() if isinstance(k, int))
    # the probabilities (B/M x heads x T x T floats, and the softmax's own saved copies) go
    per_block = 4 * 2 * 8 * 8 * 4  # micro-batch 4, 2 heads, 8 x 8, fp32
    assert saved[False] - saved["attention"] >= per_block
    if True in saved:
        assert saved[True] < saved["attention"]


@pytest.mark.slow
def test_activation_memory_follows_the_schedule():
    gpipe = run("gpipe", 2, 4)[0]
    one_f = run("1f1b", 2, 4)[0]
    # device 0 holds all 4 micro-batches under gpipe, 2 (= S) under 1f1b; the same per micro-batch
    assert gpipe.activation_bytes[0] == 2 * one_f.activation_bytes[0] > 0
    assert gpipe.activation_bytes[1] == 4 * one_f.activation_bytes[1]  # the last stage: 1


def test_bad_combinations_are_refused_at_start():
    model = reference()[0]
    two = placement.balanced(model, DEVICES[:2])
    chunked = placement.balanced(model, DEVICES[:2], chunks=2)
    assert chunked.devices == ["/cpu:0", "/cpu:1", "/cpu:0", "/cpu:1"] and chunked.chunks == 2
    with pytest.raises(placement.PlacementError, match="multiple of 2 .got 3"):
        placement.Pipeline(model, chunked, micro_batches=3, schedule="interleaved")
    with pytest.raises(placement.PlacementError, match=r"chunks=2\)"):
        placement.Pipeline(model, two, micro_batches=2, schedule="interleaved")
    with pytest.raises(placement.PlacementError, match="use schedule='interleaved'"):
        placement.Pipeline(model, chunked, micro_batches=2, schedule="1f1b")
    with pytest.raises(placement.PlacementError, match=r"8 stage groups, but the model has only 6 stages: use at most 3 devices, chunks=1 \(one group per device: schedule gpipe, 1f1b or zb-h1\), or a deeper model"):
        placement.balanced(gpt(depth=2), DEVICES, chunks=2)
    with pytest.raises(placement.PlacementError, match="remat='attention'"):
        placement.Pipeline(model, two, micro_batches=2, schedule="zb-h1", remat=True)
    with pytest.raises(placement.PlacementError, match="remat=.sometimes."):
        placement.Pipeline(model, two, micro_batches=2, remat="sometimes")
    with pytest.raises(placement.PlacementError, match="record=False on TPU"):
        placement.Pipeline(model, tpu_cores.logical(two), micro_batches=2, record=True)
    with pytest.raises(placement.PlacementError, match="leave unit_times out"):
        placement.Pipeline(model, two, micro_batches=2, schedule="1f1b", unit_times=MEASURED)
    zb = placement.Pipeline(model, two, micro_batches=2, schedule="zb-h1")
    with pytest.raises(placement.PlacementError, match="inside tf.function"):
        zb.forward_backward(*batch(), share)


class LogicalCoreStrategy:
    """Stands in for TPUStrategy: `extended.experimental_logical_device(s)` scopes, and a
    variable creator that puts a variable on the core in scope (TPUStrategy creates it on
    `_tpu_devices[:, logical_device]`; /cpu:s stands in for core s)."""

    def __init__(self):
        self.stack, self.created, self.annotated = [0], [], []
        self.extended = self

    @contextlib.contextmanager
    def experimental_logical_device(self, core):
        self.stack.append(core)
        try:
            yield
        finally:
            self.stack.pop()

    def experimental_assign_to_logical_device(self, tensor, core):
        self.annotated.append(core)
        return tf.identity(tensor)

    def create(self, next_creator, **kwargs):
        with tf.device(f"/cpu:{self.stack[-1]}"):
            variable = next_creator(**kwargs)
        self.created.append((variable.name, self.stack[-1]))
        return variable


def test_tpu_stage_variables_are_created_under_their_logical_core(monkeypatch):
    strategy = LogicalCoreStrategy()
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: strategy)
    template = gpt()
    plan = tpu_cores.logical(placement.balanced(template, DEVICES[:2], chunks=2))
    assert plan.devices == ["logical:0", "logical:1", "logical:0", "logical:1"]
    with tf.variable_creator_scope(strategy.create), plan.scope():  # the strategy's creator outside
        model = gpt()
    assert len(strategy.created) == len(model.weights)
    for name, layer in model.stages():
        core = tpu_cores.logical_core(plan.device_of(name))
        for v in layer.weights:
            assert tf.DeviceSpec.from_string(v.value.device).device_index == core, (name, v.path)
    assert {core for _, core in strategy.created} == {0, 1}
    model.set_weights(reference()[0].get_weights())
    pipe = placement.Pipeline(model, plan, micro_batches=2, schedule="interleaved")
    loss, grads = tf.function(lambda: pipe.forward_backward(*batch(), share))()
    assert_like_unsplit(loss, grads)
    # per micro-batch: 3 forward hand-overs into groups 1-3, 3 gradients back, 1 input into group 0
    assert sorted(strategy.annotated) == sorted([0, 1, 0, 1] * 2 + [0, 1, 0] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,stages,remat", [(s, 2, "attention") for s in ("interleaved", "zb-h1", "zb-v")]
                         + [(s, 4, False) for s in ("interleaved", "zb-h1", "zb-v")])
def test_a_trainer_with_each_schedule_trains_like_the_unsplit_model(schedule, stages, remat):
    import keras

    from tfpar.loop import Trainer

    x, y, w = batch()
    dataset = tf.data.Dataset.from_tensors((x, y, w)).repeat()
    keras.utils.set_random_seed(0)
    base = gpt()
    initial = base.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    Trainer(base, sgd(), loss, steps_per_loop=2).fit(dataset, steps=4)
    plan = placement.balanced(base, DEVICES[:stages], chunks=1 if schedule == "zb-h1" else 2,
                              layout="v" if schedule == "zb-v" else "round_robin")
    with plan.scope():
        model = gpt()
    model.set_weights(initial)
    pipe = placement.Pipeline(model, plan, micro_batches=4, schedule=schedule, remat=remat)
    Trainer(model, sgd(), loss, placement=pipe, steps_per_loop=2).fit(dataset, steps=4)
    for a, b in zip(model.get_weights(), base.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for name, layer in model.stages():
        for v in layer.weights:
            want = tf.DeviceSpec.from_string(plan.device_of(name)).device_index
            assert tf.DeviceSpec.from_string(v.value.device).device_index == want


# ZB-V: 2S groups in a V, group g on device g and 2S-1-g (device 0 holds the first and the last)
ZB_V_BUBBLE = {(2, 4): 0.04, (2, 8): 0.0204, (4, 4): 0.1111, (4, 8): 0.0588}  # = (S-1)/(6M+S-1)
# the embedding-and-head device slower to B, quicker to W: the F=B=W order waits there
UNEQUAL = {**{(k, 0): t for k, t in zip("FBW", (1.0, 2.0, 0.5))},
           **{(k, d): 1.0 for k in "FBW" for d in (1, 2, 3)}}


def test_zb_v_orders_run_every_unit_once_on_its_v_device_and_reach_the_least_bubble():
    for stages in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 8):
            orders = schedules.order("zb-v", stages, 2 * stages, m)
            assert [sorted(o) for o in orders] == [
                sorted((k, g, i) for g in (d, 2 * stages - 1 - d) for k in "FBW" for i in range(m))
                for d in range(stages)]
            # never more than 2S group micro-batches held (F done, W not): half-size groups,
            # so 1F1B's S micro-batches of device 0, on every device
            assert max(schedules.held(orders)) <= 2 * stages
    for (stages, m), expected in ZB_V_BUBBLE.items():
        zb_v = schedules.bubble_theory("zb-v", stages, 2 * stages, m)
        # zero bubble after the warm-up: device S-1 waits S-1 forwards for its first input,
        # then is never idle again (the least any order can do), every device the same
        assert zb_v == pytest.approx((stages - 1) / (6 * m + stages - 1)) == pytest.approx(expected, abs=1e-4)
        zb_h1 = schedules.bubble_theory("zb-h1", stages, stages, m)
        assert zb_v < zb_h1 < schedules.bubble_theory("1f1b", stages, stages, m)


def test_zb_v_orders_for_the_unit_times_it_is_given():
    def makespan(order):
        return max(end for _, end in schedules.simulate(order, len(order) * 2, UNEQUAL, split_backward=True).values())

    for stages in (2, 4):
        profiled = schedules.order("zb-v", stages, 2 * stages, 8, UNEQUAL)
        equal_times = schedules.order("zb-v", stages, 2 * stages, 8)
        assert [sorted(o) for o in profiled] == [sorted(o) for o in equal_times]
        assert max(schedules.held(profiled)) <= 2 * stages
        assert makespan(profiled) < makespan(equal_times)
    # S=2: device 0 (16 units of each kind: 56 s of work) is never idle; the F=B=W order takes 62.5
    assert makespan(schedules.order("zb-v", 2, 4, 8, UNEQUAL)) == pytest.approx(16 * 3.5)
    assert makespan(schedules.order("zb-v", 2, 4, 8)) == pytest.approx(62.5)


@pytest.mark.parametrize("stages,micro_batches", [
    pytest.param(n, m, marks=() if (n, m) in ((2, 2), (2, 4)) else pytest.mark.slow)
    for n in (2, 4) for m in (1, 2, 4, 8)])
def test_zb_v_equals_the_unsplit_model(stages, micro_batches):
    profiled = {(k, d): t for (k, d), t in UNEQUAL.items() if d < stages} if micro_batches == 4 else None
    pipe, loss, grads, timings = run("zb-v", stages, micro_batches, record=True, unit_times=profiled)
    assert pipe.plan.devices == [DEVICES[min(g, 2 * stages - 1 - g)] for g in range(2 * stages)]
    assert_like_unsplit(loss, grads)
    assert timings.shape == (2 * stages * 3 * micro_batches, 6)
    for d, order in enumerate(pipe.order):  # each device runs its units in order, one at a time
        mine = {(int(g), int(m), int(k)): (a, b) for dev, m, k, a, b, g in timings if dev == d}
        spans = [mine[(g, m, placement.pipeline.KIND[kind])] for kind, g, m in order]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), d
        assert {g for _, g, _ in order} == {d, 2 * stages - 1 - d}


def test_zb_v_holds_the_layer_activations_of_1f1b_plus_its_group_inputs():
    """A chain of L equal layers, each saving one tensor T (its output; a group also saves
    its input): 1F1B's device 0 holds S micro-batches x (L/S + 1) tensors, ZB-V's devices
    2S x (L/(2S) + 1): both L layer activations, plus S or 2S group inputs."""
    import keras

    from tfpar.models import Chain

    layers, stages, m = 8, 4, 8
    chain = Chain.from_keras(keras.Sequential(
        [keras.Input((16,))] + [keras.layers.Dense(16, activation="relu") for _ in range(layers)]))
    x, y = tf.random.normal([16, 16], seed=1), tf.random.normal([16, 16], seed=2)

    def peaks(schedule, **plan):
        pipe = placement.Pipeline(chain, placement.balanced(chain, DEVICES[:stages], **plan),
                                  micro_batches=m, schedule=schedule)
        tf.function(lambda: pipe.forward_backward(
            x, y, None, lambda y, out, w: tf.reduce_sum(tf.square(out - y)))).get_concrete_function()
        return pipe.activation_bytes

    tensor = 16 // m * 16 * 4  # one micro-batch's (2, 16) fp32 activation
    one_f = peaks("1f1b")
    zb_v = peaks("zb-v", chunks=2, layout="v")
    assert one_f[0] == stages * (layers // stages + 1) * tensor == (layers + stages) * tensor
    assert [zb_v[d] for d in range(1, stages)] == [(layers + 2 * stages) * tensor] * (stages - 1)
    assert zb_v[0] <= (layers + 2 * stages + 1) * tensor  # + the loss's (out - y) on the last group


def test_zb_v_bad_combinations_are_refused_at_start():
    model = reference()[0]
    two = placement.balanced(model, DEVICES[:2])
    round_robin = placement.balanced(model, DEVICES[:2], chunks=2)
    v = placement.balanced(model, DEVICES[:2], chunks=2, layout="v")
    assert v.devices == ["/cpu:0", "/cpu:1", "/cpu:1", "/cpu:0"] and v.chunks == 2
    assert [v.device_index(g) for g in range(4)] == [0, 1, 1, 0]
    for plan in (two, round_robin):
        with pytest.raises(placement.PlacementError,
                           match=r"zb-v' needs 2 stage groups per device in a V.*layout='v'\)"):
            placement.Pipeline(model, plan, micro_batches=4, schedule="zb-v")
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        with pytest.raises(placement.PlacementError, match="in a V .layout='v'.: only schedule='zb-v' runs it"):
            placement.Pipeline(model, v, micro_batches=4, schedule=schedule)
    with pytest.raises(placement.PlacementError, match="round robin: plan = balanced"):
        placement.Pipeline(model, v, micro_batches=4, schedule="interleaved")
    for chunks, layout in ((3, "v"), (1, "v"), (2, "zigzag")):
        with pytest.raises(placement.PlacementError, match="layout='v' with chunks=2"):
            placement.balanced(model, DEVICES[:2], chunks=chunks, layout=layout)
    with pytest.raises(placement.PlacementError, match="remat='attention'"):
        placement.Pipeline(model, v, micro_batches=4, schedule="zb-v", remat=True)
    with pytest.raises(placement.PlacementError, match="use 4 groups"):
        schedules.order("zb-v", 2, 2, 4)
    zb_v = placement.Pipeline(model, v, micro_batches=1, schedule="zb-v")  # M < S runs (a bigger bubble)
    assert zb_v.bubble_theory() == pytest.approx(1 / 3)
    with pytest.raises(placement.PlacementError, match="inside tf.function"):
        zb_v.forward_backward(*batch(), share)


def test_a_stamp_on_a_gpu_waits_for_the_data_not_for_the_queue():
    """A GPU kernel is only queued when ops after it by control dependency run: a stamp on a
    GPU stage waits on a host-side CheckNumerics of one element read after its float inputs,
    in the graph that runs (after Grappler, which turns ops feeding only control edges into
    NoOps); stamps (already on the host) and other devices' stages keep plain control inputs.
    Structural: this machine has no GPU, so the device string alone picks the path."""
    from tfpar.placement.pipeline import Pipeline

    graph = tf.Graph()
    with graph.as_default():
        h, g = tf.random.uniform([4, 3]), tf.random.uniform([0])  # an empty gradient too
        earlier = tf.timestamp()
        on_cpu = Pipeline._stamp([h, g, earlier], "/device:CPU:1")
        on_gpu = Pipeline._stamp([h, g, earlier], "/job:localhost/replica:0/task:0/device:GPU:0")
        on_tpu_core = Pipeline._stamp([h], "logical:0")
    assert {op.name for op in on_cpu.op.control_inputs} == {h.op.name, g.op.name, earlier.op.name}
    assert [op.name for op in on_tpu_core.op.control_inputs] == [h.op.name]

    options = tf.compat.v1.RunOptions(output_partition_graphs=True)
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph) as session:  # Grappler runs, as in tf.function
        session.run(on_gpu, options=options, run_metadata=metadata)
    nodes = {n.name: n for partition in metadata.partition_graphs for n in partition.node}
    controls = [i[1:] for i in nodes[on_gpu.op.name].input if i.startswith("^")]
    probes = [nodes[c] for c in controls if nodes[c].op == "CheckNumerics"]
    assert len(probes) == 1, [(c, nodes[c].op) for c in controls]

    def ancestors(node, data_only=False):
        seen, stack = set(), [node]
        while stack:
            node = stack.pop()
            for name in node.input:
                if data_only and name.startswith("^"):
                    continue
                name = name.lstrip("^").split(":")[0]
                if name not in seen:
                    seen.add(name)
                    stack.append(nodes[name])
        return seen

    assert h.op.name in ancestors(probes[0], data_only=True)  # the probe reads h's data
    assert g.op.name in ancestors(probes[0])  # and waits for every float input
    assert earlier.op.name not in ancestors(probes[0])
