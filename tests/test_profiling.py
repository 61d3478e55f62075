"""tfpar.profiling: a profiled window of steps, its breakdown read back from the trace, the
communication log, stragglers, and nothing at all when profiling is off."""

from __future__ import annotations

import os
import socket
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from scripts import fit_model
from tfpar import config as config_lib
from tfpar.compression import accounting
from tfpar.controller import Controller
from tfpar.loop import Trainer
from tfpar.profiling import ProfileError, ProfileSteps, ProfileWindow, report, stragglers, trace

PS = 10 ** 9  # picoseconds in a millisecond


def _event(start_ms: float, end_ms: float, name: str = "op:Op", **stats) -> trace.Event:
    return trace.Event(name, int(start_ms * PS), int((end_ms - start_ms) * PS), stats)


def test_each_instant_of_a_step_goes_to_one_part_and_the_parts_sum_to_the_step():
    step = trace.Step(3, start=0, duration=100 * PS)
    step.compute += [_event(0, 40), _event(10, 20)]
    step.collectives += [("all_reduce", _event(30, 70, "while/CollectiveReduceV2:CollectiveReduceV2")),
                         ("all_gather", _event(65, 75, "CollectiveGatherV2:CollectiveGatherV2"))]
    step.inputs.append(_event(60, 90, "IteratorGetNextOp::DoCompute"))
    parts = trace.breakdown(step)
    # compute first, then the collectives in their order (hidden communication is not a
    # wait), then input, the rest idle
    assert parts["compute"] == pytest.approx(0.040) and parts["all_reduce"] == pytest.approx(0.030)
    assert parts["all_gather"] == pytest.approx(0.005) and parts["input"] == pytest.approx(0.015)
    assert parts["idle"] == pytest.approx(0.010)
    assert sum(parts.values()) == pytest.approx(step.seconds, abs=1e-12)


def test_traced_names_lose_their_control_flow_path():
    names = ["CollectiveReduceV2", "while/CollectiveReduceV2", "while/cond_1/CollectiveGatherV2"]
    assert trace.graph_name("while/body/_1/while/CollectiveReduceV2", names) == "while/CollectiveReduceV2"
    assert trace.graph_name("while/body/_1/while/cond_1/then/_5/while/cond_1/CollectiveGatherV2",
                            names) == "while/cond_1/CollectiveGatherV2"
    assert trace.graph_name("CollectiveReduceV2", names) == "CollectiveReduceV2"
    # another function's op of the same base name (the preemption agreement) is not the step's
    assert trace.graph_name("tfpar_preemption/CollectiveReduceV2", names) == "tfpar_preemption/CollectiveReduceV2"


def test_the_slowest_worker_is_named_only_past_the_threshold():
    assert stragglers.slowest([200.0, 300.0, 205.0]) == (1, 95.0)
    assert stragglers.slowest([200.0, 210.0]) is None  # 2.5% over the median
    assert stragglers.slowest([50.0]) is None


@pytest.mark.parametrize("value, message", [
    ("x", "is not START,STOP"), ("5,3", "1 <= START <= STOP"), ("5,700", "ends after the run's last step"),
])
def test_bad_profile_steps_name_the_key(value, message):
    config = config_lib.base_config()
    config.train.profile_steps = value
    with pytest.raises(config_lib.ConfigError, match=message) as raised:
        config_lib.validate(config)
    assert "config.train.profile_steps" in str(raised.value)


def test_profile_steps_under_parameter_server_are_refused_by_name():
    config = config_lib.base_config()
    config.strategy, config.mode, config.train.profile_steps = "parameter_server", "loop", "3,4"
    with pytest.raises(config_lib.ConfigError, match="client.trace"):
        config_lib.validate(config)


def _mirrored(replicas: int):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def _trainer(strategy, **options):
    with strategy.scope():
        model = fit_model.build_model()
        model.set_weights(fit_model.initial_weights())
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    return model, Trainer(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy, **options)


def _slow_input(seconds: float, steps: int):
    """fit_model's batches, each one `seconds` late from the input pipeline."""
    def late(x, y):
        x = tf.py_function(lambda t: (time.sleep(seconds), t)[1], [x], tf.int32)
        return tf.ensure_shape(x, [fit_model.GLOBAL_BATCH, fit_model.SEQ]), y
    return fit_model.dataset(steps).map(late)


def _profiled_fit(tmp_path, dataset, steps: int, first: int, last: int):
    strategy = _mirrored(2)
    model, trainer = _trainer(strategy)
    window = ProfileWindow(first, last, str(tmp_path / "profile" / "worker_0"))
    controller = Controller(total_steps=steps, steps_per_loop=4, profile=window, say=lambda line: None)
    trainer.fit(strategy.experimental_distribute_dataset(dataset), steps=steps, controller=controller)
    summary = report.analyse(window, worker=0, group_size=2, graph_collectives=controller.profile_collectives())
    return trainer, strategy, summary


def test_a_profiled_window_reads_back_with_its_steps_collectives_and_a_slow_input(tmp_path):
    steps = 10  # the prefetched batches are used up before the window (steps 6-8)
    trainer, strategy, summary = _profiled_fit(tmp_path, _slow_input(0.15, steps), steps, 6, 8)
    assert [row["step"] for row in summary["per_step"]] == [6, 7, 8]
    for row in summary["per_step"]:  # the parts cover each step's period on the host clock
        assert sum(row[part] for part in trace.PARTS) == pytest.approx(row["seconds"], rel=1e-9)
        assert row["seconds"] == pytest.approx(row["host_seconds"], rel=0.05)
        assert row["input"] > 0.5 * row["seconds"]  # 150 ms of the input's sleep in each step
    # the communication log: every collective of each step's call, with the bytes counted
    # from the traced step's graph (both local replicas'); the embedding's sparse rows are
    # gathered at sizes that depend on the batch: no bytes there, as in the graph's count
    traced = trainer.traced_step(strategy.experimental_distribute_dataset(fit_model.dataset(steps)))
    counted, found = accounting.bytes_per_replica(traced), accounting.collectives(traced)
    dynamic = {c.name for c in accounting.dynamic(found)}
    for step in (6, 7, 8):
        rows = [r for r in summary["comm_log"] if r["step"] == step and r["in_step"]]
        assert {r["kind"] for r in rows} == {"all_reduce", "all_gather"} and all(r["ms"] > 0 for r in rows)
        assert sum(r["bytes"] for r in rows if r["bytes"] is not None) == 2 * counted
        assert {r["name"] for r in rows if r["bytes"] is None} == dynamic
    assert summary["bandwidth"]["all_reduce"]["algbw_gbs"] > 0
    path = report.draw([summary], str(tmp_path / "breakdown.png"))
    assert os.path.getsize(path) > 5000


def _graph(trainer, strategy) -> list[str]:
    traced = trainer.traced_step(strategy.experimental_distribute_dataset(fit_model.dataset()))
    return sorted(op.type for g in accounting.graphs(traced) for op in g.get_operations())


def test_with_profiling_off_no_profiler_runs_and_the_step_graph_is_the_profiled_ones(tmp_path, monkeypatch):
    profiled, strategy, _ = _profiled_fit(tmp_path, fit_model.dataset(3), 3, 2, 2)
    monkeypatch.setattr(tf.profiler.experimental, "start", lambda *a, **k: pytest.fail("profiler started"))
    _, plain = _trainer(strategy)
    controller = Controller(total_steps=3, steps_per_loop=4, say=lambda line: None)
    plain.fit(strategy.experimental_distribute_dataset(fit_model.dataset(3)), steps=3, controller=controller)
    assert _graph(plain, strategy) == _graph(profiled, strategy)
    assert plain.own_step_seconds() is None


@pytest.mark.slow  # the two-worker straggler test runs the timer end to end in the fast tier's stead
def test_the_step_timer_adds_up_each_replicas_own_part(tmp_path):
    strategy = _mirrored(2)
    _, trainer = _trainer(strategy, step_timer=True)
    assert _graph(trainer, strategy).count("Timestamp") == 1 + 2  # the step's start, each replica's end
    trainer.fit(strategy.experimental_distribute_dataset(_slow_input(0.05, 4)), steps=4)
    assert trainer.own_step_seconds() > 4 * 0.05 * 0.9  # each step waits for its late batch


def test_the_keras_callback_profiles_a_plain_fit_and_refuses_several_steps_per_call(tmp_path):
    model = fit_model.build_model()
    fit_model.compile_model(model)
    callback = ProfileSteps(2, 3, str(tmp_path / "fit"), say=None)
    model.fit(fit_model.dataset(), epochs=1, steps_per_epoch=fit_model.STEPS, verbose=0, callbacks=[callback])
    assert [row["step"] for row in callback.summary["per_step"]] == [2, 3]
    assert (tmp_path / "fit" / "breakdown.json").exists() and (tmp_path / "fit" / "breakdown.png").exists()
    fit_model.compile_model(model, steps_per_execution=2)
    with pytest.raises(ProfileError, match="steps_per_execution=1"):
        model.fit(fit_model.dataset(), epochs=1, steps_per_epoch=2, verbose=0,
                  callbacks=[ProfileSteps(1, 1, str(tmp_path / "two"), say=None)])


def test_a_tfds_dataset_without_network_fails_at_once_with_the_fix(tmp_path, monkeypatch):
    from tfpar.data import tfds_source
    from tfpar.errors import DataError

    def no_network(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", no_network)
    started = time.monotonic()
    with pytest.raises(DataError, match="no network: storage.googleapis.com") as raised:
        tfds_source.tfds_splits("tfds:cifar10", data_dir=str(tmp_path))
    assert time.monotonic() - started < 10 and "--config.data.data_dir" in str(raised.value)
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=4):  # TFDS's mock downloads nothing: no probe
        assert tfds_source.tfds_splits("tfds:cifar10", data_dir=str(tmp_path)).info["kind"] == "image"


def test_the_binary_in_process_profiles_its_window_and_reports_mfu(tmp_path, capsys, monkeypatch):
    """The binary's path (tfpar.run) with profile_steps: the window's lines, breakdown.json,
    the picture and results.json's profile, FLOPs against the CPU's timed matmul."""
    import json

    from procs import train_in_process

    argv = ["tfpar-train", "--config=configs/gpt_tiny.py", f"--workdir={tmp_path}", "--config.mode=loop",
            "--config.model_args.dim=32", "--config.model_args.depth=1", "--config.data.seq_len=32",
            "--config.train.steps=4", "--config.train.batch_size=8", "--config.train.steps_per_loop=4",
            "--config.train.eval_examples=32", "--config.train.eval_batch_size=32", "--config.sample.length=0",
            "--config.train.profile_steps=3,4"]
    train_in_process(argv, monkeypatch)
    said = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert "profile: steps 3-4, worker 0:" in said and "MFU" in said
    assert [row["step"] for row in results["profile"]["per_step"]] == [3, 4]
    assert 0 < results["profile"]["mfu"] and results["profile"]["flops_per_step"] > 0
    assert "matmul measured now" in results["profile"]["peak_source"]
    assert (tmp_path / "profile" / "worker_0" / "breakdown.json").exists()
    assert (tmp_path / "profile" / "breakdown.png").exists()


def test_datasheet_peaks_are_found_by_the_chip_in_the_device_name():
    from tfpar.profiling import peak

    assert peak.datasheet_peak("/GPU:0 NVIDIA H100 80GB HBM3", "mixed_bfloat16") == 989.4e12
    assert peak.datasheet_peak("/TPU:0 TPU v5 lite", "float32") == 197.0e12
    assert peak.datasheet_peak("/GPU:0 NVIDIA L40S", "float32") == 183.0e12  # not L4's
    assert peak.datasheet_peak("/cpu:0", "float32") is None


def test_nccl_kernels_and_tpu_vms_are_named_for_what_they_are(monkeypatch):
    from tfpar.profiling import peak

    assert trace.nccl_kind("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, ...)") == "all_gather"
    assert trace.nccl_kind("ncclDevKernel_SendRecv(...)") == "send_recv" and trace.nccl_kind("sgemm_128") is None
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert peak.device_peak("/device:TPU:0", "mixed_bfloat16") == (197.0e12, "datasheet, /device:TPU:0 TPU v5")


class _Info:
    def __init__(self, task_type="worker", task_index=0, replicas=2):
        self.task_type, self.task_index, self.replicas = task_type, task_index, replicas


class _Resolver:
    def __init__(self, spec):
        self.spec = spec

    def cluster_spec(self):
        return tf.train.ClusterSpec(self.spec)


def test_workers_beside_a_chief_are_numbered_after_it():
    from tfpar.profiling import binary

    class Strategy:
        cluster_resolver = _Resolver({"chief": ["a:1"], "worker": ["b:1", "c:1"]})

    assert binary.worker_rank(Strategy(), _Info("chief", 0)) == 0
    assert [binary.worker_rank(Strategy(), _Info("worker", i)) for i in (0, 1)] == [1, 2]
    Strategy.cluster_resolver = _Resolver({"worker": ["b:1", "c:1"]})
    assert binary.worker_rank(Strategy(), _Info("worker", 1)) == 1


@pytest.mark.parametrize("start, window", [(0, (3, 5)), (3, (5, 5)), (4, None), (2, (4, 5)), (5, None)])
def test_a_resumed_run_never_profiles_its_first_step(tmp_path, start, window):
    """The first call after a restore traces the step function: a window starting there
    starts a step later, or is said not to run."""
    from tfpar.profiling import binary

    config = config_lib.base_config()
    config.train.profile_steps = "3,5"
    said = []
    found = binary.profile_window(config, _Info(), tf.distribute.get_strategy(), str(tmp_path), start, said.append,
                                  lambda: None, None, (None, ""), {})
    assert (found and (found.first, found.last)) == (window or None)
    assert bool(said) == (window != (3, 5))  # a window moved or dropped is said
