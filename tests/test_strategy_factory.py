"""create_strategy: names, options, `auto`, describe, and the errors of each."""

import json

import pytest
import tensorflow as tf

import tfpar
from tfpar.strategy import keras_backend
from tfpar.strategy import factory, keras_fixes, tpu as tpu_lib


@pytest.mark.parametrize("name,expected", [
    ("default", "default"), ("OFF", "default"), ("one_device", "one_device"),
    ("Mirrored", "mirrored"), ("mwms", "multi_worker_mirrored"),
    ("multi-worker-mirrored", "multi_worker_mirrored"), ("PS", "parameter_server"),
    ("tpu", "tpu"), (" auto ", "auto"),
])
def test_names_and_aliases(name, expected):
    assert factory.normalize_name(name) == expected


@pytest.mark.parametrize("name,suggestion", [("mirored", "mirrored"), ("one-devic", "one_device"),
                                             ("paramserver", "parameter_server")])
def test_unknown_name_lists_all_and_suggests_the_closest(name, suggestion):
    with pytest.raises(tfpar.UnknownStrategyError) as info:
        tfpar.create_strategy(name)
    message = str(info.value)
    assert f"Did you mean {suggestion!r}" in message
    for known in factory.STRATEGY_NAMES:
        assert known in message


def test_describe_each_local_kind():
    mirrored = tfpar.describe(tfpar.create_strategy("mirrored"))
    assert (mirrored.kind, mirrored.replicas, mirrored.num_workers) == ("mirrored", 4, 1)
    assert mirrored.is_chief and mirrored.task_type is None
    assert [d.rsplit(":", 1)[-1] for d in mirrored.devices] == ["0", "1", "2", "3"]
    one = tfpar.describe(tfpar.create_strategy("one_device", devices=["/cpu:1"]))
    assert (one.kind, one.replicas) == ("one_device", 1) and one.devices[0].endswith("CPU:1")
    default = tfpar.describe(tfpar.create_strategy("off"))
    assert default.kind == "default" and default.devices == ("/device:CPU:0",)
    assert keras_fixes.is_applied()


def test_the_default_strategy_is_described_on_the_first_gpu(monkeypatch):
    """TensorFlow places ops on GPU:0 when there is one; tfpar-check on an H200 reported
    (and measured its matmul on) CPU:0, the first logical device listed."""
    from tfpar.strategy import runtime

    monkeypatch.setattr(runtime, "local_compute_devices", lambda: ["/device:GPU:0", "/device:GPU:1"])
    assert tfpar.describe(tfpar.create_strategy("off")).devices == ("/device:GPU:0",)


def test_all_reduce_options_map_to_cross_device_ops():
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"],
                                     all_reduce="hierarchical_copy", num_packs=2)
    ops = strategy.extended._cross_device_ops  # pylint: disable=protected-access
    assert isinstance(ops, tf.distribute.HierarchicalCopyAllReduce)
    strategy = tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"], all_reduce="one_device")
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)  # pylint: disable=protected-access


@pytest.mark.parametrize("name,options,message", [
    ("mirrored", {"all_reduce": "nccl"}, "needs GPUs"),
    ("mirrored", {"all_reduce": "ring"}, "collective ring of multi_worker_mirrored"),
    ("mirrored", {"all_reduce": "rign"}, "Did you mean 'ring'"),
    ("mirrored", {"timeout_s": 5}, "timeout_s do not apply"),
    ("one_device", {"devices": ["/cpu:0", "/cpu:1"]}, "exactly one device"),
    ("default", {"all_reduce": "nccl"}, "all_reduce do not apply"),
    ("mwms", {"all_reduce": "hierarchical_copy"}, "mirrored \\(single-machine\\) option"),
    ("mirrored", {"num_packs": -1}, "num_packs must be"),
])
def test_options_that_do_not_fit_are_refused(name, options, message):
    with pytest.raises(tfpar.StrategyOptionError, match=message):
        tfpar.create_strategy(name, **options)


def test_virtual_devices_after_start_says_it_is_too_late():
    assert tfpar.create_strategy("mirrored", virtual_devices=4).num_replicas_in_sync == 4
    with pytest.raises(tfpar.RuntimeAlreadyStartedError, match="before TensorFlow starts"):
        tfpar.create_strategy("mirrored", virtual_devices=2)


def test_multi_worker_after_start_says_it_is_too_late(monkeypatch):
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(tfpar.RuntimeAlreadyStartedError, match="restart the Python process"):
        tfpar.create_strategy("multi_worker_mirrored")


def test_bad_tf_config_fails_before_any_strategy_exists(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}')
    with pytest.raises(tfpar.ClusterConfigError, match="out of range"):
        tfpar.create_strategy("auto")


def test_parameter_server_without_a_cluster_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(tfpar.StrategyOptionError, match="tfpar-launch --chief --workers 2 --ps 1"):
        tfpar.create_strategy("parameter_server")


def test_missing_tpu_lists_what_was_tried(monkeypatch):
    for var in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tpu_lib.glob, "glob", lambda pattern: [])
    with pytest.raises(tfpar.TPUNotFoundError) as info:
        tfpar.create_strategy("tpu")
    message = str(info.value)
    for tried in ("tpu='local'", "PCI 0x1ae0", "TPU_NAME", "create_strategy('auto')"):
        assert tried in message


def test_named_tpu_that_does_not_answer_is_reported(monkeypatch):
    def no_tpu(tpu):
        raise ValueError(f"Could not find TPU {tpu}")

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", no_tpu)
    with pytest.raises(tfpar.TPUNotFoundError, match="tpu='my-tpu'.*Could not find TPU my-tpu"):
        tfpar.create_strategy("tpu", tpu="my-tpu")


def test_tpu_candidates_in_order():
    environ = {"COLAB_TPU_ADDR": "10.0.0.2:8470", "TPU_NAME": "pod"}
    names = [name for name, _ in tpu_lib.tpu_candidates(None, environ)]
    assert names[0] == "pod" and names[-1] == "grpc://10.0.0.2:8470"  # named first, legacy last
    assert tpu_lib.tpu_candidates("local", environ) == [("local", "tpu='local' was given")]


@pytest.mark.parametrize("environ,expected", [
    ({}, "default"),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]},
                               "task": {"type": "worker", "index": 0}})}, "multi_worker_mirrored"),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["h0:1"], "worker": ["h1:1"], "ps": ["h2:1"]},
                               "task": {"type": "chief", "index": 0}})}, "parameter_server"),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["h0:1"]},
                               "task": {"type": "worker", "index": 0}})}, "default"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
      "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "0"}, "multi_worker_mirrored"),
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, "tpu"),
])
def test_auto_decides_from_what_is_there(monkeypatch, environ, expected):
    for var in ("TF_CONFIG", "COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID",
                "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(tpu_lib.glob, "glob", lambda pattern: [])
    kind, _, reason = factory._decide(None, None)  # pylint: disable=protected-access
    assert kind == expected and reason


# -- the Keras backend ---------------------------------------------------------------------

def test_keras_backend_jax_gets_tfpars_message_not_no_module_named_jax():
    """KERAS_BACKEND=jax (set on some TPU images), jax not installed: `import keras` itself
    fails ("No module named 'jax'"), so the check runs before anything imports Keras."""
    from procs import run_python

    done = run_python(["-c", "import tfpar; tfpar.create_strategy('auto')"], timeout=120,
                      KERAS_BACKEND="jax")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfpar.errors.KerasBackendError: ") and "'jax' (KERAS_BACKEND=jax)" in last
    assert "unset KERAS_BACKEND or set it to tensorflow" in last and "jax is not installed" in last
    assert "ModuleNotFoundError" not in done.stderr


def test_a_keras_json_naming_another_backend_is_refused_with_its_path(tmp_path):
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch", "floatx": "float32"}))
    environ = {"KERAS_HOME": str(tmp_path)}
    assert keras_backend.keras_backend(environ, modules={}) == (
        "torch", f'"backend": "torch" in {tmp_path / "keras.json"}')
    with pytest.raises(keras_backend.KerasBackendError, match=r'set "backend": "tensorflow" in .*keras\.json'):
        keras_backend.check_keras_backend(environ, modules={})
    assert keras_backend.keras_backend({**environ, "KERAS_BACKEND": "tensorflow"}, modules={})[0] == "tensorflow"
    assert keras_backend.keras_backend({}, modules={})[0] in ("tensorflow", "jax", "torch", "numpy")


def test_keras_imported_with_another_backend_is_refused_by_name(monkeypatch):
    import keras

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(keras_backend.KerasBackendError, match="set to 'jax'.*restart"):
        tfpar.create_strategy("default")
    assert isinstance(keras_backend.KerasBackendError("x"), (tfpar.TfparError, ImportError))


def test_runtime_started_is_false_until_the_first_op():
    """What create_strategy reads before configuring devices (a fresh Python: the tests'
    own process started TensorFlow at import)."""
    import subprocess
    import sys

    code = ("from tfpar.strategy import private_api; import tensorflow as tf; before = private_api.runtime_started(); "
            "tf.constant(1.0); print(before, private_api.runtime_started())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
