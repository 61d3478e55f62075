"""ZeRO on a tensor-parallel model (`Trainer(shard=...)` with a GPT split T ways): each
variable is partitioned over its data-parallel group. On 2 data x 2 tensor replicas (4
logical CPUs) AdamW with weight decay and a global clip that bites trains like the unsplit,
unsharded model on one device; each device holds 1/(R x T) of the split weights' optimizer
state (and 1/R of the replicated weights'), read from the variables created; the replicated
weights stay the same bits on all 4 replicas; the checkpoint holds whole slots and restores
into the unsharded split run and the sharded unsplit run, and back; what cannot work is
refused by name."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import tensor_parallel as tp
from tfpar import zero
from tfpar.checkpoints import Checkpoints
from tfpar.data.pipeline import same_batch_for_groups
from tfpar.errors import ShardingError
from tfpar.loop import Trainer, TrainerError
from tfpar.models.gpt import GPT
from tfpar.tensor_parallel import ShardSpec
from tfpar.zero import files as zero_files
from tfpar.zero.partitions import PartitionLayout, whole_boxes

TINY = dict(vocab_size=32, max_len=8, dim=32, depth=2, heads=4)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DATA, TENSOR = 2, 2  # R data-parallel groups x T tensor-parallel ranks: 4 replicas
STEPS = 4
TOL = 1e-5


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def batches(rows=8):
    """One fixed batch per step, a different one each step."""
    found = []
    for step in range(STEPS):
        x = np.random.RandomState(step).randint(0, 32, size=(rows, 8)).astype("int32")
        found.append((x, np.roll(x, -1, axis=1), np.ones((rows, 8), "float32")))
    return tf.data.Dataset.from_tensor_slices(tuple(np.stack(t) for t in zip(*found)))


def dealt(strategy, degree, start=0, rows=8):
    """The batches from step `start`, each dealt per tensor-parallel group (tfpar's way):
    each group its 1/R of the rows, its T replicas the same ones."""
    groups = strategy.num_replicas_in_sync // degree
    data = batches(rows).skip(start).unbatch().batch(rows // groups)
    return strategy.distribute_datasets_from_function(lambda _: same_batch_for_groups(data, degree))


def adamw():
    """Decoupled weight decay (the norms excluded by name) and a global clip that bites."""
    optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.01, global_clipnorm=0.5, epsilon=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["norm"])
    return optimizer


def gpt_trainer(replicas, degree, shard="none", depth=TINY["depth"]):
    """A GPT from seed 0 split `degree` ways (1: unsplit) over `replicas` replicas (1: one
    device), and its Trainer."""
    strategy = mirrored(replicas) if replicas > 1 else tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(**{**TINY, "depth": depth}, tensor_parallel=degree)
        optimizer = adamw()
    return model, Trainer(model, optimizer, LOSS, strategy=strategy, shard=shard, xla=False), strategy


def fit(trainer, strategy, degree, start, stop):
    """Steps `start` to `stop` (one device: each step's whole batch)."""
    one = strategy.num_replicas_in_sync == 1
    trainer.fit(batches().skip(start).unbatch().batch(8) if one else dealt(strategy, degree, start),
                steps=stop, start_step=start)


@functools.lru_cache(maxsize=None)
def one_device(depth=TINY["depth"]):
    """The ground truth: the unsplit, unsharded GPT on one device after STEPS steps (its
    weights, its optimizer, its initial weights)."""
    model, trainer, strategy = gpt_trainer(1, 1, depth=depth)
    initial = model.get_weights()
    fit(trainer, strategy, 1, 0, STEPS)
    return model.get_weights(), trainer.optimizer, initial


def assert_close(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def slot_bytes(optimizer, weights) -> int:
    """Bytes of a one-device optimizer's slots made from `weights` (Keras names each slot
    after its weight's path)."""
    names = {w.path.replace("/", "_") for w in weights}
    return sum(int(np.prod(v.shape)) * 4 for v in optimizer.variables
               if v.path.split("/")[-1].rsplit("_", 1)[0] in names)


def partitioned_slot_bytes(trainer, split: bool) -> dict:
    """Bytes per device of the partitioned slots made from split (or replicated) weights,
    read from every copy of the variables the sharded optimizer created."""
    sharded = trainer._sharded
    variables = trainer.model.trainable_variables
    slots = [v for k, v in enumerate(sharded.shard.clone.variables)
             if k in sharded.shard.slot_of and (tp.spec_of(variables[sharded.shard.slot_of[k]]) is not None) == split]
    return dict(zero.device_bytes(slots))


# -- the same training ---------------------------------------------------------------------

@pytest.mark.usefixtures("without_grappler")  # numbers do not depend on it; 4 replicas trace faster
@pytest.mark.parametrize("mode,depth", [("gradients", 1), pytest.param("gradients", 2, marks=pytest.mark.slow),
                                        pytest.param("optimizer", 2, marks=pytest.mark.slow)])
def test_zero_over_data_parallel_groups_trains_like_one_device(mode, depth):
    """2 data x 2 tensor replicas, 4 steps of AdamW with weight decay (the norms excluded)
    and a global clip: the weights of the unsplit, unsharded model on one device (1e-5).
    Each device holds 1/(R x T) of the split weights' Adam moments and 1/R of the
    replicated weights'; the replicated weights are the same bits on all 4 replicas, each
    shard the same bits on the 2 replicas of its data-parallel group. (The fast tier: one
    block; the slow: two, and ZeRO-1.)"""
    expected, plain, initial = one_device(depth)
    model, trainer, _ = gpt_trainer(DATA * TENSOR, TENSOR, shard=mode, depth=depth)
    fit(trainer, trainer.strategy, TENSOR, 0, STEPS)
    assert_close(model.get_weights(), expected)
    assert max(np.abs(a - b).max() for a, b in zip(expected, initial)) > 1e-2
    assert int(trainer.optimizer.iterations.numpy()) == STEPS

    split = [w for w in model.trainable_variables if tp.spec_of(w) is not None]
    replicated = [w for w in model.trainable_variables if tp.spec_of(w) is None]
    assert split and replicated
    for weights, share, held in ((split, DATA * TENSOR, True), (replicated, DATA, False)):
        whole = slot_bytes(plain, weights)  # m and v of those weights, one device
        per_device = partitioned_slot_bytes(trainer, held)
        assert len(per_device) == DATA * TENSOR and set(per_device.values()) == {whole // share}, (held, per_device, whole)

    for weight in model.weights:  # replicas 0 and 2 hold shard 0, replicas 1 and 3 shard 1
        copies = [c.numpy() for _, c in tp.shards.copies(weight)]
        if tp.spec_of(weight) is None:
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=weight.path)
        else:
            np.testing.assert_array_equal(copies[0], copies[2], err_msg=weight.path)
            np.testing.assert_array_equal(copies[1], copies[3], err_msg=weight.path)
            assert not np.array_equal(copies[0], copies[1]), weight.path


# -- checkpoints ---------------------------------------------------------------------------

def slots_in(path) -> dict:
    """Every optimizer slot (and counter) a checkpoint holds, by key."""
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith("optimizer/")}


def run(workdir, replicas, degree, shard, start, stop, depth=1):
    """Restores the newest checkpoint in `workdir` (at `start`), trains to `stop`, saves;
    returns (model, checkpoint path)."""
    model, trainer, strategy = gpt_trainer(replicas, degree, shard, depth)
    checkpoints = Checkpoints(str(workdir), True, model=model,
                              **{"optimizer": trainer.optimizer, **trainer.checkpoint_items()})
    assert checkpoints.restore() == start
    if stop > start:
        fit(trainer, strategy, degree, start, stop)
    return model, checkpoints.save(stop)


def assert_same_slots(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    assert sum(k.startswith("optimizer/_variables/") for k in expected) == 2 * (6 + 16)  # m, v of the 22 weights (embeddings, head, one block)
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.usefixtures("without_grappler")
@pytest.mark.parametrize("other", [(4, 2, "none"), (4, 1, "gradients")], ids=["unsharded_split", "sharded_unsplit"])
def test_a_checkpoint_restores_across_sharding_and_splitting_and_back(tmp_path, other):
    """ZeRO-1 x TP (2 x 2, one block) trains 2 steps and saves: each slot is written whole,
    as slices (each replica its chunk, a replicated weight's chunks once), under the keys
    the other run (the unsharded split run, or the sharded unsplit run on 4 replicas)
    writes; the other run restores it, its own save holds the same values (1e-6), and it
    trains on to the one-device weights. The other run's checkpoint restores into
    ZeRO-2 x TP the same way (1e-6), which trains on to them too."""
    replicas, degree, shard = other
    expected = one_device(1)[0]
    _, ours = run(tmp_path / "forth", DATA * TENSOR, TENSOR, "optimizer", 0, 2)
    for key, slices in zero_files.stored_slices(ours).items():  # every element written once
        if key.startswith("optimizer/_variables/"):
            size = int(np.prod(tf.train.load_checkpoint(ours).get_variable_to_shape_map()[key]))
            assert sum(int(np.prod(n)) for _, _, n in slices) == size and len(slices) >= DATA, key
    _, theirs = run(tmp_path / "forth", replicas, degree, shard, 2, 2)  # restored, saved at once
    assert_same_slots(slots_in(theirs), slots_in(ours))
    model, _ = run(tmp_path / "forth", replicas, degree, shard, 2, STEPS)
    assert_close(model.get_weights(), expected)

    _, theirs = run(tmp_path / "back", replicas, degree, shard, 0, 2)
    _, ours = run(tmp_path / "back", DATA * TENSOR, TENSOR, "gradients", 2, 2)
    assert_same_slots(slots_in(ours), slots_in(theirs))
    model, _ = run(tmp_path / "back", DATA * TENSOR, TENSOR, "gradients", 2, STEPS)
    assert_close(model.get_weights(), expected)


def test_a_chunk_of_a_fused_shard_lands_at_its_place_in_the_whole_weight():
    """A fused weight (Q, K, V side by side, each split T ways): every replica's chunk of
    its shard, cut into boxes and placed by `whole_boxes`, reads exactly its elements of the
    whole weight, and the chunks of all replicas cover it once."""
    spec = ShardSpec(axis=1, degree=2, parts=3)
    whole = np.arange(5 * 12 * 2).reshape(5, 12, 2)
    covered = np.zeros(whole.shape, int)
    for rank, shard in enumerate(spec.split(whole)):
        layout = PartitionLayout([tf.Variable(shard)], replicas=3)
        for k in range(3):
            start, stop = layout.run(0, k)
            chunk = shard.reshape(-1)[start:stop]
            read = []
            for box in layout.boxes(0, k):
                pieces = []
                for (starts, lengths), (lo, hi) in whole_boxes(box, spec, shard.shape, rank):
                    region = tuple(slice(s, s + n) for s, n in zip(starts, lengths))
                    covered[region] += 1
                    pieces.append(whole[region])
                assert sum(p.shape[1] for p in pieces) == box[1][1]
                read.append(np.concatenate(pieces, axis=1).reshape(-1))
            np.testing.assert_array_equal(np.concatenate(read), chunk)
    assert (covered == 1).all()


def test_what_cannot_work_with_a_split_model_is_refused_by_name():
    strategy = mirrored(2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = GPT(**{**TINY, "depth": 1}, tensor_parallel=2)
    for optimizer, message in [
            (keras.optimizers.Lamb(0.01), r"shard='gradients' with Lamb and a tensor-parallel model: .*Use AdamW"),
            (keras.optimizers.AdamW(0.01, clipnorm=1.0), r"clipnorm=1.0 and a tensor-parallel model: .*Use global_clipnorm"),
            (keras.optimizers.Adafactor(0.01), "cannot run Adafactor on a shard")]:
        with pytest.raises(ShardingError, match=message):
            Trainer(model, optimizer, LOSS, strategy=strategy, shard="gradients")
    with pytest.raises(TrainerError, match="a compression would sum"):
        Trainer(model, keras.optimizers.AdamW(0.01), LOSS, strategy=strategy, shard="optimizer",
                compression=tfpar.compression.FP16())
    with pytest.raises(ShardingError, match="compression fp16: the split model sums its own"):
        zero.checks.check_split_model("optimizer", keras.optimizers.AdamW(0.01), tfpar.compression.Compression(
            tfpar.compression.FP16()))
