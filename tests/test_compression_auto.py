"""compression="auto": the choice from measured factors, one decision (replica 0's) for every
worker, kept in checkpoints, and a build whose cost does not grow with the model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_compression import mirrored, mlp, mlp_data
from tfpar import compression as C
from tfpar.checkpoints import Checkpoints
from tfpar.compression import auto as auto_lib
from tfpar.compression import auto_probes as probes
from tfpar.compression import replica_state
from tfpar.loop import Trainer
from tfpar.tensor_parallel import shards

M = 1 << 20  # entries: 4 M bytes in float32
# link bytes / float32's over a run to quality, as Auto computes them for gpt_wide-like models
RATIOS = {"none": 1.0, "fp16": 0.5, "powersgd": 0.12, "onebit_adam": 0.11, "dgc_adam": 0.12, "dgc": 0.03}


def adamw():
    return keras.optimizers.AdamW(1e-3, global_clipnorm=1.0)


def trainer_for(strategy, auto, optimizer=adamw, weights=None):
    with strategy.scope():
        model = mlp()
        if weights is not None:
            model.set_weights(weights)
        made = optimizer()
    return model, Trainer(model, made, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, compression=auto)


def test_the_choice_is_none_on_a_fast_link_and_keeps_the_model_on_a_slow_one():
    """A pure function of the link, the compute, the ratios, the steps factors and the
    optimizer: fp16 costs its overhead, so a fast link keeps none; a slow one under AdamW
    gets a compressor that carries the optimizer (dgc_adam, factor 1); SGD never gets one
    that needs Adam; a factor above 1 only where the run has room for it."""
    for link in (1e-6, 1e-3, 0.01, 0.04):
        for kind in (None, "adam", "momentum_sgd"):
            name, predicted = auto_lib.choose(link, 0.1, RATIOS, optimizer=kind)
            assert name == "none" and predicted["fp16"] > predicted["none"], (link, kind, predicted)
    name, predicted = auto_lib.choose(4.0, 0.1, RATIOS, optimizer="adam")
    assert name == "dgc_adam" and auto_lib.BY_NAME[name].steps_factor <= 1
    assert predicted["onebit_adam"] < predicted["fp16"]  # close, but needs 1.08x the steps: left out
    for kind in (None, "momentum_sgd"):
        for link in (0.5, 4.0, 100.0):
            for room in (1.0, 2.0):
                name = auto_lib.choose(link, 0.1, RATIOS, optimizer=kind, room=room)[0]
                assert name not in ("onebit_adam", "dgc_adam"), (kind, link, room)
    assert auto_lib.choose(4.0, 0.1, RATIOS, optimizer="momentum_sgd")[0] == "fp16"  # dgc never reached none's loss
    assert auto_lib.choose(4.0, 0.1, RATIOS, optimizer="momentum_sgd", room=2.0)[0] == "powersgd"  # 1.17x fits
    assert auto_lib.choose(4.0, 0.1, RATIOS | {"onebit_adam": 0.02}, optimizer="adam", room=1.5)[0] == "onebit_adam"
    assert auto_lib.choose(4.0, 0.1, RATIOS, factors={"dgc_adam": 1.2}, optimizer="adam")[0] == "fp16"
    assert auto_lib.choose(0.0, 0.1, RATIOS, optimizer="adam")[0] == "none"
    # the factors are the measured ones (benchmarks/results, cited in tfpar/compression/auto.py)
    assert {c.name: round(c.steps_factor, 3) for c in auto_lib.CANDIDATES} == {
        "none": 1.0, "fp16": 1.0, "powersgd": 1.167, "onebit_adam": 1.083, "dgc_adam": 1.0, "dgc": np.inf,
        "diloco": 1.083}
    assert auto_lib.optimizer_kind(keras.optimizers.AdamW()) == "adam"
    assert auto_lib.optimizer_kind(keras.optimizers.SGD(0.1, momentum=0.9)) == "momentum_sgd"
    assert auto_lib.optimizer_kind(keras.optimizers.SGD(0.1)) is None
    assert auto_lib.optimizer_kind(keras.optimizers.Adam(amsgrad=True)) is None


def test_every_replica_builds_replica_0s_decision(monkeypatch):
    """Replicas that measured differently still build one candidate: replica 0's, which the
    others receive through one all-reduce of a few floats."""
    strategy = mirrored(2)
    agreed = probes.from_replica_0(strategy, lambda replica: [replica + 1.0, 10.0 * (replica + 1)])
    assert agreed == [1.0, 10.0]
    with strategy.scope():
        model = mlp()
    for slow, expected in ((0, "dgc_adam"), (1, "none")):
        monkeypatch.setattr(C.Auto, "_measurements", lambda self, strategy, variables, slow=slow: (
            lambda replica: (4.0, 0.1, 0.0) if replica == slow else (1e-6, 0.1, 0.0)))
        auto = C.Auto(total_steps=20)
        auto.check_optimizer(adamw())
        with strategy.scope():
            auto.build(model.trainable_variables)
        assert auto_lib.CANDIDATES[auto.index].name == expected, auto.decision
        assert auto.decision.startswith(f"{expected}: link {4 if slow == 0 else 1e-6:.4g} s"), auto.decision


def test_a_restored_run_keeps_the_decision_and_its_state(tmp_path):
    """The binary's resume: a checkpoint restored before the Trainer builds gives the
    decision of the run that wrote it (not a new measurement) and the chosen compressor's
    state, replica by replica. Restored after build with another decision, the first step
    refuses it, naming the fix."""
    strategy = mirrored(2)
    keras.utils.set_random_seed(0)
    weights = mlp().get_weights()
    data = strategy.experimental_distribute_dataset(mlp_data(steps=3))
    slow = C.Auto(total_steps=20, link_s=10.0, compute_s=0.1)  # the link dominates: dgc_adam
    model, trainer = trainer_for(strategy, slow, weights=weights)
    assert isinstance(slow.chosen, C.DGCAdam) and slow.chosen.clip_norm == 1.0  # AdamW's global_clipnorm
    assert type(trainer.optimizer) is keras.optimizers.SGD  # applies dgc_adam's Adam step
    trainer.fit(data, steps=3)  # past its freeze step (2): state in every replica
    saved = {p: [v.numpy() for v in strategy.experimental_local_results(s)]
             for p, s in replica_state.state_by_path(slow.chosen)}
    Checkpoints(str(tmp_path), True, model=model, optimizer=trainer.optimizer, **trainer.checkpoint_items()).save(3)

    fast = C.Auto(total_steps=20, link_s=1e-6, compute_s=0.1)  # measured alone: none
    assert Checkpoints(str(tmp_path), True, **fast.checkpoint_items()).restore() == 3  # before build
    model, resumed = trainer_for(strategy, fast)
    assert isinstance(fast.chosen, C.DGCAdam) and fast.decision.startswith("dgc_adam: restored from the checkpoint")
    for path, variable in replica_state.state_by_path(fast.chosen):
        for value, own in zip(strategy.experimental_local_results(variable), saved[path]):
            np.testing.assert_array_equal(value.numpy(), own, err_msg=path)
    # then everything, as the binary restores after building
    Checkpoints(str(tmp_path), True, model=model, optimizer=resumed.optimizer, **resumed.checkpoint_items()).restore()
    resumed.fit(data, steps=1, start_step=3)

    late = C.Auto(total_steps=20, link_s=1e-6, compute_s=0.1)
    _, built = trainer_for(strategy, late, weights=weights)  # none, then the checkpoint
    Checkpoints(str(tmp_path), True, **late.checkpoint_items()).restore()
    with pytest.raises(C.CompressionError, match="holds another decision .dgc_adam; this run built "
                                                 "none.: restore the checkpoint before building the Trainer"):
        built.fit(data, steps=1)
    with pytest.raises(C.CompressionError, match="decision is dgc_adam, which needs Adam or AdamW"):
        restored = C.Auto(total_steps=20)
        Checkpoints(str(tmp_path), True, **restored.checkpoint_items()).restore()
        trainer_for(strategy, restored, optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))


def test_build_makes_only_the_chosen_state_and_reduces_a_bounded_number_of_bytes(monkeypatch):
    """On a model of 5M floats (20 MB of gradient) build all-reduces at most 4 MB + 256 kB
    per timing (each run 4 times) and two agreements of a few floats, counted from what the
    traced functions hand to the collective; the candidates it did not choose make no
    variables, and the compute proxy stays within its budget for any model."""
    strategy = mirrored(2)
    reduced, created = [], []
    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        reduced.append(sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(value)))
        return all_reduce(self, reduce_op, value, options)

    def creating(next_creator, **kwargs):
        created.append(next_creator(**kwargs))
        return created[-1]

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", counting)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([4 * M]), name="big_bias"),
                     tf.Variable(tf.zeros([1024, 1024]), name="kernel")]
    handed = {}
    for link_s in (None, 10.0):  # timed (whatever it picks), and slow: dgc_adam and its state
        auto = C.Auto(total_steps=20, tokens=64, link_s=link_s)
        auto.check_optimizer(adamw())
        reduced.clear(), created.clear()
        with strategy.scope(), tf.variable_creator_scope(creating):
            auto.build(variables)
        assert {id(v) for v in created} == {id(v) for v in auto.state_variables()}, auto.decision
        assert len(created) == len(auto.state_variables())
        handed[link_s] = (sum(reduced) / 2, max(reduced))  # each of the 2 replicas traces its share
    assert isinstance(auto.chosen, C.DGCAdam) and created
    assert 0 < handed[None][0] <= 4 * (M + M // 16) + 64 and handed[None][1] <= 4 * M, handed
    assert handed[10.0][0] <= 64, handed  # given seconds: only the two agreements
    sampled, rows, scale = probes.proxy_plan([(8192, 8192)] * 96, tokens=4096)
    assert sum(n * m for n, m in sampled) <= probes.PROXY_WEIGHTS
    assert 6 * rows * sum(n * m for n, m in sampled) <= probes.PROXY_FLOPS
    assert scale * rows * sum(n * m for n, m in sampled) == pytest.approx(4096 * 96 * 8192 ** 2)


def test_auto_measures_at_build_becomes_its_choice_and_says_why(capsys):
    """With SGD and momentum on a slow link: fp16 (powersgd needs 1.17x the steps, dgc never
    reached none's loss), said in one printed line; the step sends what its choice sends."""
    strategy = mirrored(2)
    slow = C.Auto(total_steps=20, link_s=10.0)  # the compute is timed
    _, trainer = trainer_for(strategy, slow, lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    said = capsys.readouterr().out  # printed, not logged: seen at any log level
    assert said.count("compression=auto picked fp16: link 10 s") == 1, said
    assert isinstance(slow.chosen.compressor, C.FP16) and slow.boundaries() == ()
    assert "powersgd left out: needs 1.17x the steps, the run has 1x" in slow.decision
    assert "time_to_quality.json" in slow.decision and "dgc left out: never reached none's loss" in slow.decision
    assert "onebit_adam left out: needs Adam or AdamW" in slow.decision
    dataset = strategy.experimental_distribute_dataset(mlp_data(steps=2))
    trainer.fit(dataset, steps=2)
    counted = C.accounting.bytes_per_replica(trainer.traced_step(dataset, "compressed"),
                                             in_loops_only=True, checks=False)
    assert counted == sum(slow.payload_bytes(trainer.model.trainable_variables).values())
    assert slow.describe(trainer.model.trainable_variables) == slow.chosen.describe(trainer.model.trainable_variables)
    assert C.from_config("auto", auto_total_steps=100).total_steps == 100


def test_auto_leaves_out_a_candidate_that_cannot_run_on_the_model():
    auto = C.Auto(total_steps=20, link_s=10.0, compute_s=0.1)  # powersgd's rank 16 on [4096, 4]
    auto.build([tf.Variable(tf.zeros([4096, 4]), name="thin")])
    assert isinstance(auto.chosen.compressor, C.FP16), auto.decision
    assert "powersgd cannot run on this model: powersgd rank 16 is larger than the matrix" in auto.decision


def test_the_binary_gives_auto_the_runs_steps_and_tokens_per_replica():
    from types import SimpleNamespace

    from tfpar import config as config_lib, run as run_lib
    from tfpar.models.vit import ViT

    config = config_lib.base_config()
    config.compression, config.train.steps, config.train.batch_size = "auto", 300, 8
    run = SimpleNamespace(config=config, asynchronous=False, info=SimpleNamespace(replicas=2),
                          splits=SimpleNamespace(info={"kind": "lm", "max_len": 64}))
    auto = run_lib.compression_for(run, model=None)
    assert (auto.total_steps, auto.tokens) == (300, 4 * 64)  # 8 / 2 replicas x 64 positions
    run.splits.info = {"kind": "image", "image_size": 16, "channels": 3}
    config.compression_args.auto_total_steps = 50  # set: wins over train.steps
    auto = run_lib.compression_for(run, ViT(image_size=16, patch_size=4, channels=3, dim=16, heads=2))
    assert (auto.total_steps, auto.tokens) == (50, 4 * 16)  # 16 patches of 4 x 4
    assert auto.quality_steps == 50  # by default the run's own length: no room for more steps
    config.compression_args.auto_quality_steps = 25
    run.splits.info = {"kind": "lm", "max_len": 64}
    assert run_lib.compression_for(run, model=None).quality_steps == 25


def test_auto_weighs_diloco_and_the_trainer_runs_the_diloco_it_picks(tmp_path):
    """DiLoCo (10 local steps, plain averaging, int4) pays its latency once a round and
    needs 13/12 of none's steps: on a slow link it wins where the run has room for them,
    and not where it has none. Picked in tfpar.Trainer (a 10 s link, 24 steps to reach the
    loss none reaches in 12), the Trainer runs that DiLoCo: the same weights as a Trainer
    given it by hand (its ratio is its int4 gather every 10 steps over a float32
    all-reduce); the decision is checkpointed, and a run restored at step 12 (the decision
    before build, the rest after) ends on the uninterrupted run. Outside a Trainer it is
    left out by name, and a restored DiLoCo decision that cannot run is refused."""
    from tfpar.sync import DiLoCo
    from tfpar.sync import outer_compression

    ratios = RATIOS | {"diloco": 0.0129}  # gpt_tiny's at 2 workers (benchmarks/results/diloco)
    assert auto_lib.choose(1.0, 0.11, ratios, optimizer="adam", room=2.0, latency_s=0.002)[0] == "diloco"
    assert auto_lib.choose(1.0, 0.11, ratios, optimizer="adam", room=1.0)[0] == "dgc_adam"  # 1.08x: no room
    assert auto_lib.choose(1e-3, 0.11, ratios, optimizer="adam", room=2.0)[0] == "none"

    strategy = mirrored(2)
    keras.utils.set_random_seed(0)
    weights = mlp().get_weights()
    data = mlp_data(steps=24)

    def auto_run(start, end, workdir=None):
        auto = C.Auto(total_steps=24, quality_steps=12, link_s=10.0, compute_s=0.1)
        if workdir is not None and start:  # the binary's order: the decision before build
            assert Checkpoints(str(workdir), True, **auto.checkpoint_items()).restore() == start
        model, trainer = trainer_for(strategy, auto, weights=weights)
        checkpoints = None if workdir is None else Checkpoints(
            str(workdir), True, model=model, optimizer=trainer.optimizer, **trainer.checkpoint_items())
        if checkpoints is not None and start:
            checkpoints.restore()
        trainer.fit(strategy.experimental_distribute_dataset(data.skip(start)), steps=end, start_step=start)
        if checkpoints is not None:
            checkpoints.save(end)
        return model, trainer, auto

    model, trainer, auto = auto_run(0, 20)
    assert auto_lib.CANDIDATES[auto.index].name == "diloco", auto.decision
    assert isinstance(trainer._sync, DiLoCo) and trainer._sync is auto.chosen_sync  # pylint: disable=protected-access
    assert "the Trainer runs DiLoCo(inner_steps=10, compression='int4') with plain averaging" in auto.decision
    size = sum(int(np.prod(w.shape)) for w in weights)
    gathered = outer_compression.BlockCode(4).payload_bytes(size) + 8
    predicted_ratio = gathered / 10 / (4 * size)  # 2 workers: a gather sends its payload once, a ring all-reduce 4N
    assert f"diloco {auto_lib.choose(10.0, 0.1, {'diloco': predicted_ratio}, room=2.0)[1]['diloco']:.4g}" \
        in auto.decision
    with strategy.scope():
        by_hand = mlp()
        by_hand.set_weights(weights)
        sync = DiLoCo(inner_steps=10, outer_optimizer=keras.optimizers.SGD(1.0), compression="int4")
        hand = Trainer(by_hand, adamw(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       strategy=strategy, sync=sync)
    hand.fit(strategy.experimental_distribute_dataset(data), steps=20)
    assert max(np.abs(a - b).max() for a, b in zip(by_hand.get_weights(), weights)) > 1e-3
    for a, b in zip(model.trainable_variables, by_hand.trainable_variables):
        for (_, x), (_, y) in zip(shards.copies(a), shards.copies(b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)

    auto_run(0, 12, tmp_path)
    resumed, _, restored = auto_run(12, 20, tmp_path)
    assert restored.decision.startswith("diloco: restored from the checkpoint"), restored.decision
    for a, b in zip(resumed.trainable_variables, model.trainable_variables):
        for (_, x), (_, y) in zip(shards.copies(a), shards.copies(b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)

    alone = C.Auto(total_steps=24, quality_steps=12, link_s=10.0, compute_s=0.1)
    with strategy.scope():
        alone.build(mlp().trainable_variables)
    assert "diloco left out: DiLoCo runs in tfpar.Trainer only" in alone.decision
    bare = C.Auto(total_steps=24)
    Checkpoints(str(tmp_path), True, **bare.checkpoint_items()).restore()
    with pytest.raises(C.CompressionError, match="decision is diloco, which this run cannot take .DiLoCo runs "
                                                 "in tfpar.Trainer only."):
        with strategy.scope():
            bare.build(mlp().trainable_variables)
