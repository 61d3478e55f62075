"""Layer placement: plans, and pipelines whose loss and gradients equal the unsplit model's."""

import contextlib

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


@pytest.mark.parametrize("schedule,micro_batches,remat,stages", [  # every schedule x S x M on an
    ("naive", 1, False, 2), ("gpipe", 4, False, 2),  # unplaced model: test_pipeline_schedules.py
    ("1f1b", 4, True, 2), ("gpipe", 2, True, 4)])
def test_pipeline_loss_and_gradients_equal_the_unsplit_model(schedule, micro_batches, remat, stages):
    """The model built under plan.scope() (its variables on their stage devices), and
    whole-stage remat."""
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
    assert [[(k, m) for k, _, m in o] for o in placement.schedule_order("1f1b", 2, 4)] == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]]
    gpipe = placement.schedule_order("gpipe", 2, 2)[1]
    assert gpipe == [("F", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 0)]


def test_trainer_with_a_pipeline_trains_like_the_unsplit_model(tmp_path):
    import keras

    from tfpar.loop import Trainer

    x, y, w = batch()
    dataset = tf.data.Dataset.from_tensors((x, y, w)).repeat()
    keras.utils.set_random_seed(0)
    reference = small_gpt()
    initial = reference.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # SGD keeps the reference independent of how sparse rows reach the optimizer.
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
    timings = tf.function(lambda: (pipe.forward_backward(x, y, w, share), pipe.timings)[::-1])()[0].numpy()
    assert timings.shape == (16, 6) and np.all(timings[:, 4] >= timings[:, 3])
    units = {(int(s), int(m), int(k)): (a, b) for s, m, k, a, b, _ in timings}
    for s, order in enumerate(pipe.order):  # each stage's units in schedule order, not overlapping
        spans = [units[(s, m, 0 if kind == "F" else 1)] for kind, _, m in order]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), s
    for m in range(4):  # data dependencies: stage 1's forward follows stage 0's; backward, reversed
        first, then = units[(0, m, 0)], units[(1, m, 0)]
        assert first[0] <= then[0] and first[1] <= then[1]
        first, then = units[(1, m, 1)], units[(0, m, 1)]
        assert first[0] <= then[0] and first[1] <= then[1]
    summary = placement.timeline.draw(timings, str(tmp_path / "gantt.png"), gif=str(tmp_path / "p.gif"))
    assert 0 <= summary["bubble"] < 1 and summary["bubble_theory"] == pytest.approx(1 / 5)
    assert (tmp_path / "gantt.png").stat().st_size > 1000 and (tmp_path / "p.gif").stat().st_size > 1000


def test_alone_speedup_compares_units_alone_with_units_beside_another_device():
    # (device, micro-batch, kind, start, end, group): device 0's forwards take 1 s alone and
    # 1.5 s beside device 1's; the half-overlapped pair (3.0-4.0 / 2.5-3.5) counts for neither
    timings = np.array([[0, 0, 0, 0.0, 1.0, 0], [0, 1, 0, 1.0, 2.5, 0], [0, 2, 0, 3.0, 4.0, 0],
                        [1, 0, 0, 1.0, 2.5, 1], [1, 1, 0, 2.5, 3.5, 1], [1, 2, 0, 4.0, 4.8, 1],
                        # a third device, beside the same instants as device 1: not counted twice
                        # (summed, the half-overlapped 3.0-4.0 would seem fully beside others)
                        [2, 0, 0, 1.0, 2.5, 2], [2, 1, 0, 3.0, 3.5, 2]])
    found = placement.timeline.alone_speedup(timings)
    # device 2 never runs alone: left out
    assert found == {"F0": pytest.approx(1.5), "F1": pytest.approx(1.5 / 0.8)}


def _train(model, trainer_kwargs, strategy, steps=4):
    """SGD with momentum for `steps` steps on one fixed global batch of 8."""
    import keras

    from tfpar.loop import Trainer

    x, y, w = batch()
    dataset = tf.data.Dataset.from_tensors((x, y, w)).repeat().unbatch().batch(8)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      strategy=strategy, steps_per_loop=2, **trainer_kwargs)
    trainer.fit(strategy.experimental_distribute_dataset(dataset), steps=steps)
    return trainer


@pytest.mark.parametrize("compression", [None, "topk"])
def test_hybrid_two_replicas_of_a_two_stage_pipeline_train_like_one_device(compression):
    import keras

    from tfpar import compression as compression_lib

    keras.utils.set_random_seed(0)
    reference = small_gpt()
    reference.build((None, 8))
    initial = reference.get_weights()
    _train(reference, {}, tf.distribute.get_strategy())

    plan = placement.balanced(reference, DEVICES[:2]).replicate(DEVICES)
    assert plan.replica_devices == (("/cpu:0", "/cpu:1"), ("/cpu:2", "/cpu:3"))
    assert "/cpu:1, /cpu:3" in plan.table()
    with plan.scope() as strategy:
        model = small_gpt()
        model.build((None, 8))
    assert strategy is plan.strategy and strategy.num_replicas_in_sync == 2
    model.set_weights(initial)
    pipe = placement.Pipeline(model, plan, micro_batches=2, schedule="1f1b", record=True)
    options = {"compression": compression_lib.TopK(1.0)} if compression else {}  # ratio 1: exact
    trainer = _train(model, {"placement": pipe, **options}, strategy)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    def index(device):
        return tf.DeviceSpec.from_string(device).device_index

    momentum = {m.path.split("/")[-1]: m for m in trainer.optimizer.variables}
    for v in model.trainable_variables:  # every replica's copy, and its slot, on its stage device
        stage = next(name for name, layer in model.stages() if any(v is lv for lv in layer.weights))
        slot = momentum[v.path.replace("/", "_") + "_momentum"]
        for r, (copy, slot_copy) in enumerate(zip(v.value.values, slot.value.values)):
            want = index(plan.device_of(stage, replica=r))
            assert index(copy.device) == index(slot_copy.device) == want, (v.path, r)
    assert set(pipe.timings_by_replica) == {0, 1}


def test_a_hybrid_plan_needs_its_own_strategy():
    import keras

    from tfpar.loop import Trainer

    model = small_gpt()
    plan = placement.balanced(model, DEVICES[:2]).replicate(DEVICES)
    with pytest.raises(placement.PlacementError, match="multiple of 2 devices"):
        placement.balanced(model, DEVICES[:2]).replicate(DEVICES[:3])
    pipe = placement.Pipeline(model, plan, micro_batches=2)
    # its order replayed at equal unit times has the schedule's theoretical bubble
    assert pipe.bubble_replayed({"F": 1.0, "B": 1.0, "W": 1.0}) == pytest.approx(pipe.bubble_theory())
    with pytest.raises(Exception, match="own strategy"):
        Trainer(model, keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(),
                placement=pipe)


def fake_tpu(mesh_shape):
    """A TPU topology built in memory: one task, cores enumerated x-major."""
    x_n, y_n, z_n, c_n = mesh_shape
    coords = [[x, y, z, c] for z in range(z_n) for y in range(y_n) for x in range(x_n) for c in range(c_n)]
    return tf.tpu.experimental.Topology(mesh_shape=mesh_shape, device_coordinates=np.array([coords], np.int32))


def test_tpu_plans_map_stages_to_logical_cores_of_each_replica():
    from tfpar.placement import tpu_cores

    plan = tpu_cores.logical(placement.balanced(small_gpt(), DEVICES[:2]))
    assert plan.devices == ["logical:0", "logical:1"]
    v3_8 = fake_tpu([2, 2, 1, 2])  # 4 chips x 2 cores
    two = tpu_cores.device_assignment(v3_8, stages=2)  # a replica = the two cores of one chip
    assert (two.num_replicas, two.num_cores_per_replica) == (4, 2)
    for r in range(4):
        chip0, chip1 = two.core_assignment[r]
        assert list(chip0[:3]) == list(chip1[:3]) and (chip0[3], chip1[3]) == (0, 1)
    four = tpu_cores.device_assignment(v3_8, stages=4)  # two neighbouring chips per replica
    assert (four.num_replicas, four.num_cores_per_replica) == (2, 4)
    cores = {tuple(c) for r in range(2) for c in four.core_assignment[r]}
    assert len(cores) == 8  # every core used once
    assert tpu_cores.computation_shape([2, 2, 1, 2], 4) == [2, 1, 1, 2]
    with pytest.raises(placement.PlacementError, match="do not divide the 8 TPU cores"):
        tpu_cores.device_assignment(v3_8, stages=3)


def test_a_tpu_pipeline_annotates_each_stage_with_its_core(monkeypatch):
    from tfpar.placement import tpu_cores

    class RecordingStrategy:  # stands in for TPUStrategy: records the annotations
        def __init__(self):
            self.cores, self.scopes = [], []
            self.extended = self

        def experimental_logical_device(self, core):
            self.scopes.append(core)
            return contextlib.nullcontext()

        def experimental_assign_to_logical_device(self, tensor, core):
            self.cores.append(core)
            return tf.identity(tensor)

    reference = small_gpt()
    x, y, w = batch()
    with tf.GradientTape() as tape:
        loss = share(y, reference(x), w)
    expected = tape.gradient(loss, reference.trainable_variables)
    recorder = RecordingStrategy()
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: recorder)
    plan = tpu_cores.logical(placement.balanced(reference, DEVICES[:2]))
    pipe = placement.Pipeline(reference, plan, micro_batches=2, schedule="1f1b")
    got, grads = pipe.forward_backward(x, y, w, share)
    np.testing.assert_allclose(got, loss, rtol=1e-6)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(e), rtol=1e-5, atol=1e-6)
    # each micro-batch enters stage 0 and stage 1 forward, and stage 0's gradient comes back
    assert sorted(recorder.cores) == [0, 0, 0, 0, 1, 1]
    assert sorted(recorder.scopes) == [0] * 4 + [1] * 4  # every unit under its stage's core


def test_plans_balance_by_counted_flops_and_measured_seconds():
    from tfpar.placement import costs

    model = GPT(vocab_size=256, max_len=16, dim=64, depth=2, heads=4)
    x = tf.zeros([4, 16], tf.int32)
    counted = costs.flops(model, x)
    names = [n for n, _ in model.stages()]
    assert list(counted) == names and all(counted[n] > 0 for n in names if n != "embed")
    # forward + backward: an MLP's two matrix products (4 * 64 * 256 FLOPs per token forward)
    # count 3x forward (input and weight gradients), plus a few % of element-wise work
    tokens, dim, hidden = 4 * 16, 64, 256
    assert 1.0 < counted["blocks.0.mlp"] / (12 * tokens * dim * hidden) < 1.1
    # attention: q, k, v, o projections (8 * dim^2 per token) and the two score products
    # (4 * seq * dim per token), 3x; TensorFlow's own count for these einsums is off by 2-9x
    assert 1.0 < counted["blocks.0.attn"] / (3 * tokens * (8 * dim * dim + 4 * 16 * dim)) < 1.1
    for name, layer, h in costs.stage_inputs(model, x):  # every weight's gradient is computed
        assert all(g is not None for g in costs._forward_backward(layer)(h)), name
    timed = costs.seconds(model, x, repeats=2)
    assert list(timed) == names and all(t > 0 for t in timed.values())
    plan = placement.balanced(model, DEVICES[:2], cost=counted)
    assert len(plan.groups) == 2
    with pytest.raises(placement.PlacementError, match="no entry for stages head"):
        placement.balanced(model, DEVICES[:2], cost={n: 1.0 for n in names[:-1]})


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("interleaved", marks=pytest.mark.slow),
                                      pytest.param("zb-h1", marks=pytest.mark.slow),
                                      pytest.param("zb-v", marks=pytest.mark.slow)])
def test_placement_read_from_the_executed_graphs(schedule):
    """The placer's log of the executed train step: every matrix product of a stage, forward
    and backward (zb-h1, zb-v: B and W), and every optimizer update of its variables runs on
    its stage's device (interleaved, zb-v: two groups per device)."""
    import json
    import re

    import procs

    result = procs.run_python([str(procs.SCRIPTS / "placement_log.py"), schedule])
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    placed = [m.groups() for m in re.finditer(r"^(\S+): \((\w+)\): \S*device:CPU:(\d+)$",
                                              result.stdout, re.MULTILINE)]
    products = [(name, int(dev)) for name, op, dev in placed if op in ("MatMul", "BatchMatMulV2", "Einsum")]
    for stage, layer in info["layers"].items():
        mine = [(name, dev) for name, dev in products if re.search(rf"/{layer}_\d+/", name)]
        if stage == "embed":
            continue  # a gather, no matrix product
        forward = [d for n, d in mine if "gradient_tape" not in n]
        backward = [d for n, d in mine if "gradient_tape" in n]
        assert forward and backward, stage
        assert set(forward) == set(backward) == {info["stages"][stage]}, stage
    updates = [int(dev) for name, op, dev in placed if op == "AssignSubVariableOp" and "/sgd/" in name]
    assert {i: updates.count(i) for i in (0, 1)} == {int(k): v for k, v in info["variables_per_device"].items()}


def _strategy_like(cls, worker_devices, replicas_in_sync=2):
    """An object of strategy class `cls` answering only `extended.worker_devices` and
    `num_replicas_in_sync`: the placement checks run before anything else touches it (a
    real multi-worker strategy needs a fresh process; tests/test_hosts.py trains one)."""
    import types

    strategy = cls.__new__(cls)
    strategy._extended = types.SimpleNamespace(worker_devices=tuple(worker_devices),
                                               _num_replicas_in_sync=replicas_in_sync)
    return strategy


def test_hybrid_across_workers_refuses_what_cannot_run():
    """One pipeline per local replica of multi_worker_mirrored, on the worker's own devices,
    which must exist; everything else is refused with what works. (Accepted plans train in
    tests/test_hosts.py::test_hybrid_over_hosts_x_pipeline_on_each_hosts_cpus.)"""
    import keras

    from tfpar.loop import Trainer, TrainerError

    model = small_gpt()
    model.build((None, 8))
    plan = placement.balanced(model, DEVICES[:2])
    worker0 = "/job:worker/replica:0/task:0/device:CPU:0"
    mwms = _strategy_like(tf.distribute.MultiWorkerMirroredStrategy, [worker0])
    plan.check_multi_worker(mwms)  # one pipeline per worker on /cpu:0, /cpu:1: fine

    def trainer(pipe_plan, strategy):
        return Trainer(model, keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(),
                       strategy=strategy, placement=placement.Pipeline(model, pipe_plan, micro_batches=2))

    with pytest.raises(TrainerError, match=r"2 pipeline replica\(s\) but multi_worker_mirrored runs 1 "
                                           r"replica\(s\) on each worker.*without replicate\(\)"):
        trainer(plan.replicate(DEVICES), mwms)
    named = placement.manual(model, {"embed-blocks.0.mlp": "/cpu:0",
                                     "blocks.1.attn-head": "/job:worker/task:1/cpu:1"})
    with pytest.raises(placement.PlacementError, match="write '/device:CPU:1', not '/job:worker/task:1"):
        with named.scope(mwms):
            pass
    with pytest.raises(placement.PlacementError, match=r"This worker has no /cpu:7 .*virtual_devices=2"):
        placement.balanced(model, ["/cpu:0", "/cpu:7"]).check_multi_worker(mwms)
    two_local = _strategy_like(tf.distribute.MultiWorkerMirroredStrategy, [worker0, worker0[:-1] + "1"], 4)
    with pytest.raises(placement.PlacementError, match="Pipeline replica 1 starts on /cpu:2 but"):
        plan.replicate(DEVICES).check_multi_worker(two_local)
    plan.replicate(["/cpu:0", "/cpu:2", "/cpu:1", "/cpu:3"]).check_multi_worker(two_local)  # lined up
    mirrored = _strategy_like(tf.distribute.MirroredStrategy, DEVICES[:2])
    with pytest.raises(placement.PlacementError, match="takes a multi_worker_mirrored strategy; got "
                                                       "MirroredStrategy"):
        with plan.scope(mirrored):
            pass
    with pytest.raises(TrainerError, match=r"1 pipeline replica\(s\) but the strategy has 2.*one "
                                           r"pipeline per worker under multi_worker_mirrored"):
        trainer(plan, mirrored)
    ps = _strategy_like(tf.distribute.experimental.ParameterServerStrategy, [worker0])
    with pytest.raises(TrainerError, match="does not run under parameter_server"):
        trainer(plan, ps)


def test_a_synthetic_gpipe_timeline_summarizes_draws_and_animates(tmp_path):
    """2 devices x 2 micro-batches of 1 s units in GPipe order (F F on device 0, then device
    1 a second later; backwards the other way): bubble 1/3 measured, theory (S-1)/(M+S-1)."""
    F, B = 0, 1  # (device, micro-batch, kind, start, end, group)
    timings = np.array([[0, 0, F, 0, 1, 0], [0, 1, F, 1, 2, 0], [1, 0, F, 1, 2, 1], [1, 1, F, 2, 3, 1],
                        [1, 0, B, 3, 4, 1], [1, 1, B, 4, 5, 1], [0, 0, B, 4, 5, 0], [0, 1, B, 5, 6, 0]], float)
    summary = placement.timeline.summarize(timings)
    assert summary["bubble"] == pytest.approx(1 / 3) and summary["bubble_theory"] == pytest.approx(1 / 3)
    assert summary["busy_by_kind_s"] == {"forward": 4.0, "backward": 4.0} and summary["makespan_s"] == 6.0
    assert placement.timeline.unit_times(timings) == {("F", 0): 1.0, ("B", 0): 1.0, ("W", 0): 0.0,
                                                      ("F", 1): 1.0, ("B", 1): 1.0, ("W", 1): 0.0}
    drawn = placement.timeline.draw(timings, str(tmp_path / "g.png"), gif=str(tmp_path / "g.gif"), title="gpipe")
    both = placement.timeline.animate({"gpipe": timings, "again": timings}, str(tmp_path / "two.gif"))
    assert drawn["bubble"] == summary["bubble"] and set(both) == {"gpipe", "again"}
    assert all((tmp_path / name).stat().st_size > 1000 for name in ("g.png", "g.gif", "two.gif"))
