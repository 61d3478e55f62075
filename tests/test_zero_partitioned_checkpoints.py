"""ZeRO checkpoints written one partition per replica (one process) and per worker (two
processes): every optimizer slot stored as slices, each from the process (and file) that
owns it, never put together to be saved; such a checkpoint restores under 1, 2 and 4
replicas and unsharded, each equal to the saved state and to continuing the run."""

import json
import sys

import numpy as np
import pytest
import tensorflow as tf

from procs import SCRIPTS, launch
from test_sharding import mirrored
from tfpar.checkpoints import Checkpoints
from tfpar.zero import checkpoint as zero_checkpoint
from tfpar.zero import files as zero_files

sys.path.insert(0, str(SCRIPTS))
import zero_partitioned_worker as worker  # noqa: E402  (the model, data and optimizer of both)

SLOT = "optimizer/_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"


def strategy_for(replicas: int):
    return tf.distribute.get_strategy() if replicas == 1 else mirrored(replicas)


def expected_slices(trainer, shard_of_rank: dict) -> dict:
    """Slot key -> sorted (data file, start, length) of every box each rank owns (a scalar
    slot is written whole by rank 0, not as slices)."""
    sharded = trainer._sharded
    found = {}
    for k, index in sharded.shard.slot_of.items():
        if sharded.layout.shapes[index]:
            found[SLOT.format(k)] = sorted((shard_of_rank[rank], *box) for rank in shard_of_rank
                                           for box in sharded.layout.boxes(index, rank))
    return found


def slot_values(trainer) -> dict:
    """Slot number (in the optimizer's variables) -> its PartitionValue."""
    sharded = trainer._sharded
    values = zero_checkpoint.slots(sharded._view, sharded.shard)
    return {sharded.shard.own_variables + i: v for i, v in enumerate(values)}


def refuse_gather(monkeypatch):
    """Fails the test if anything puts a slot together while it runs."""
    def whole(self, host=None):
        raise AssertionError(f"slot {self.index} was put together")
    monkeypatch.setattr(zero_checkpoint.PartitionValue, "whole", whole)


def test_one_process_writes_each_replicas_slices(tmp_path, monkeypatch):
    """mirrored, 2 replicas: tfpar's Checkpoints writes every slot as the two replicas'
    boxes (a few rectangles each: the sizes do not divide by 2), from their own copies,
    without putting a slot together; read back whole, each is the slot."""
    strategy = mirrored(2)
    model, trainer = worker.trainer(strategy, "gradients", worker.initial_weights())
    trainer.fit(strategy.experimental_distribute_dataset(worker.dataset()), steps=worker.SAVE_AT)
    with monkeypatch.context() as patch:
        refuse_gather(patch)
        path = worker.checkpoints(str(tmp_path), True, model, trainer.optimizer).save(worker.SAVE_AT)
    stored = zero_files.stored_slices(path)
    ranks = trainer._sharded._ranks
    expected = expected_slices(trainer, {rank: 0 for rank in ranks.values()})  # one file
    assert {k: sorted(v) for k, v in stored.items()} == expected
    assert any(len(v) > 2 for v in expected.values())  # a chunk that is several boxes
    reader = tf.train.load_checkpoint(path)
    for k, value in slot_values(trainer).items():
        np.testing.assert_array_equal(reader.get_tensor(SLOT.format(k)), value.whole().numpy())


def test_the_per_worker_path_in_one_process(tmp_path, monkeypatch):
    """The multi-worker save on one worker holding 2 replicas: its slices alone in its own
    file, the barrier, the chief's checkpoint (keys recorded, no slot value) merging that
    file in; read back, 2 data files, every slot's slices in the worker's; it restores
    into 4 replicas through Checkpoints, equal to the saved state."""
    strategy = mirrored(2)
    model, trainer = worker.trainer(strategy, "optimizer", worker.initial_weights())
    trainer.fit(strategy.experimental_distribute_dataset(worker.dataset()), steps=worker.SAVE_AT)
    one_worker = zero_files.WorkerPartitions(strategy, tasks=["worker-0"], task="worker-0")
    monkeypatch.setattr(zero_files.WorkerPartitions, "find", classmethod(lambda cls, objects: one_worker))
    with monkeypatch.context() as patch:
        refuse_gather(patch)
        path = worker.checkpoints(str(tmp_path), True, model, trainer.optimizer).save(worker.SAVE_AT)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint", "ckpt-3.data-00000-of-00002", "ckpt-3.data-00001-of-00002", "ckpt-3.index", "model.json"]
    ranks = trainer._sharded._ranks
    assert {k: sorted(v) for k, v in zero_files.stored_slices(path).items()} == expected_slices(
        trainer, {rank: 0 for rank in ranks.values()})  # the worker's file; 1: the chief's own
    saved = {k: v.whole().numpy() for k, v in slot_values(trainer).items()}

    strategy = mirrored(4)
    model, restored = worker.trainer(strategy, "gradients", worker.initial_weights())
    assert worker.checkpoints(str(tmp_path), True, model, restored.optimizer).restore() == worker.SAVE_AT
    for k, value in slot_values(restored).items():
        np.testing.assert_array_equal(value.whole().numpy(), saved[k])


# -- two workers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_worker_run(tmp_path_factory):
    """The worker script's output and workdir (see tests/scripts/zero_partitioned_worker.py)."""
    workdir = tmp_path_factory.mktemp("zero_partitions")
    result = launch(2, "zero_partitioned_worker.py", str(workdir), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout, workdir


@pytest.mark.multiprocess
def test_two_workers_write_one_partition_each(two_worker_run):
    """multi_worker_mirrored, two processes, ZeRO-2: each worker writes its own slices to its
    own file and the chief's checkpoint merges them (data files 0 and 1: the workers', 2: the
    chief's object graph and weights, no slot); no worker puts a slot together; each restores
    its own slices (state equal, then the run continues as the uninterrupted one). A worker
    that cannot write stops both (WorkdirError), and so does a workdir the chief cannot see."""
    out, workdir = two_worker_run
    for task in (0, 1):
        for line in (f"[worker:{task}] SAVED gathered=[]", f"[worker:{task}] RESUMED step=3 state_equal=True "
                     "weights_equal=True", f"[worker:{task}] FAILED raised=True"):
            assert line in out, out[-4000:]
    unshared = next(line for line in out.splitlines() if line.startswith("[worker:0] UNSHARED"))
    assert "raised=True" in unshared and "Worker worker-1 wrote its optimizer partitions" in unshared
    assert "which the chief cannot see" in unshared and "must be on a filesystem every worker sees" in unshared
    failed = next(line for line in out.splitlines() if line.startswith("[worker:1] FAILED"))
    assert "Could not write this worker's (worker-1) optimizer partitions" in failed
    path = str(workdir / "run" / "checkpoints" / f"ckpt-{worker.SAVE_AT}")
    assert sorted(p.name for p in (workdir / "run" / "checkpoints").iterdir()) == [
        "checkpoint", "ckpt-3.data-00000-of-00003", "ckpt-3.data-00001-of-00003",
        "ckpt-3.data-00002-of-00003", "ckpt-3.index", "model.json"]  # the partition files moved in
    ranks = json.loads((workdir / "ranks.json").read_text())
    shard_of_rank = {ranks[f"worker-{w}"]: w for w in (0, 1)}
    _, trainer = worker.trainer(mirrored(2), "gradients", worker.initial_weights())  # the same layout
    assert {k: sorted(v) for k, v in zero_files.stored_slices(path).items()} == expected_slices(trainer, shard_of_rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas,shard", [(1, "gradients"), (2, "optimizer"), (4, "gradients"), (2, "none")])
def test_the_two_worker_checkpoint_restores_in_one_process(two_worker_run, replicas, shard):
    """The two workers' checkpoint restores under 1, 2 and 4 replicas (mirrored, one
    process) and unsharded: the restored slots equal the saved ones (1e-6; read whole from
    the checkpoint), and the run continues as the uninterrupted two-worker run (1e-5)."""
    _, workdir = two_worker_run
    strategy = strategy_for(replicas)
    model, trainer = worker.trainer(strategy, shard, worker.initial_weights())
    items = {"optimizer": trainer.optimizer, **trainer.checkpoint_items()}
    checkpoints = Checkpoints(str(workdir / "run"), True, model=model, **items)
    assert checkpoints.restore() == worker.SAVE_AT
    reader = tf.train.load_checkpoint(checkpoints.restored)
    if shard == "none":
        restored = {k: v.numpy() for k, v in enumerate(trainer.optimizer.variables) if k > 0}
    else:
        restored = {k: v.whole().numpy() for k, v in slot_values(trainer).items()}
    assert len(restored) == 18  # m and v of 9 variables
    for k, value in restored.items():
        np.testing.assert_allclose(value, reader.get_tensor(SLOT.format(k)), rtol=1e-6, atol=1e-6)
    trainer.fit(strategy.experimental_distribute_dataset(worker.dataset(worker.SAVE_AT)), steps=worker.STEPS,
                start_step=worker.SAVE_AT)
    expected = np.load(workdir / "uninterrupted.npz")
    for i, value in enumerate(model.get_weights()):
        np.testing.assert_allclose(value, expected[f"arr_{i}"], rtol=1e-5, atol=1e-5)
