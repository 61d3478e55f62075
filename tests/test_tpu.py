"""Finding a TPU (fake /sys and /dev trees), multi-host slices (fake resolvers), `auto`'s
fallback, and data on a pod. No TPU here: TensorFlow's resolver is replaced at the one
seam tfpar owns (`tpu._initialize`)."""

import os

import pytest

import tfpar
from tfpar.data.tfds_source import check_data_dir_for_slice
from tfpar.errors import DataError, TPUNotFoundError
from tfpar.strategy import factory, tpu as tpu_lib
from tpu_standins import FakeResolver, fake_machine

TPU_ENV = ("TPU_NAME", "COLAB_TPU_ADDR", "TF_CONFIG", "TFDS_DATA_DIR") + tpu_lib.TPU_VM_VARIABLES
V5E, GVNIC, VIRTIO = ("0x1ae0", "0x0063"), ("0x1ae0", "0x0042"), ("0x1af4", "0x1041")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in TPU_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(tpu_lib._connected, "hosts", 0)  # pylint: disable=protected-access


# -- detection -------------------------------------------------------------------------

def test_tpu_chips_are_google_vendor_and_a_tpu_device_id(tmp_path):
    root = fake_machine(tmp_path, pci=[V5E, V5E, GVNIC, VIRTIO], dev=["vfio/0", "vfio/1"])
    here = tpu_lib.local_tpu(root, {})
    assert here.chips == 2 and len(here.device_nodes) == 2 and here.found


@pytest.mark.parametrize("machine", [
    {"dev_dirs": ["accel"], "dev": ["accel/accel0"]},     # Linux accel subsystem (NPU, Gaudi)
    {"pci": [GVNIC, VIRTIO]},                             # any GCE VM: Google's virtual NIC
    {"dev": ["vfio/0"]},                                  # VFIO passthrough of anything
    {},
], ids=["dev-accel-folder", "gvnic", "vfio-only", "bare"])
def test_other_machines_are_not_tpus(tmp_path, machine):
    root = fake_machine(tmp_path, **machine)
    assert not tpu_lib.local_tpu(root, {}).found
    assert tpu_lib.tpu_candidates(None, {}, root) == []
    assert factory._decide(None, None, root)[0] == "default"  # pylint: disable=protected-access


def test_tpu_v4_driver_nodes_and_tpu_vm_variables_count(tmp_path):
    root = fake_machine(tmp_path, dev=["accel0", "accel1"])
    assert tpu_lib.local_tpu(root, {}).device_nodes == (f"{root}/dev/accel0", f"{root}/dev/accel1")
    assert tpu_lib.local_tpu(str(tmp_path / "none"), {"TPU_ACCELERATOR_TYPE": "v5litepod-1"}).found


def test_named_tpu_first_colab_tpu_node_last(tmp_path):
    root = fake_machine(tmp_path, pci=[V5E])
    environ = {"COLAB_TPU_ADDR": "10.0.0.2:8470", "TPU_NAME": "pod"}
    names = [name for name, _ in tpu_lib.tpu_candidates(None, environ, root)]
    assert names == ["pod", "local", "grpc://10.0.0.2:8470"]
    assert "legacy" in tpu_lib.tpu_candidates(None, {"COLAB_TPU_ADDR": "x:1"}, root)[-1][1]
    assert tpu_lib.tpu_candidates("local", environ, root) == [("local", "tpu='local' was given")]


@pytest.mark.parametrize("accelerator,chips", [
    ("v2-8", 4), ("v3-32", 16), ("v4-32", 16), ("v5p-128", 64), ("v5litepod-16", 16),
    ("v5e-4", 4), ("v6e-8", 8), ("v6e-256", 256), ("nonsense", None),
])
def test_chips_of_a_slice_from_its_accelerator_type(accelerator, chips):
    assert tpu_lib.slice_chips(accelerator) == chips


# -- multi-host slices -----------------------------------------------------------------

def test_local_is_refused_when_the_slice_has_more_chips_than_this_host(tmp_path):
    root = fake_machine(tmp_path, pci=[V5E] * 4)
    environ = {"TPU_ACCELERATOR_TYPE": "v5litepod-16"}
    assert tpu_lib.slice_hosts(environ, root) == 4
    with pytest.raises(tpu_lib.TPUSliceError, match="spans 4 hosts.*TPU_NAME.*gs://"):
        tpu_lib.connect_tpu("local", environ, root)
    with pytest.raises(tpu_lib.TPUSliceError):
        tpu_lib.check_local_fits({"TPU_WORKER_HOSTNAMES": "h0,h1"}, root)
    tpu_lib.check_local_fits({"TPU_ACCELERATOR_TYPE": "v5litepod-4"}, root)  # one host: fine


def test_local_is_refused_after_initialising_when_the_slice_has_more_hosts(monkeypatch, tmp_path):
    monkeypatch.setattr(tpu_lib, "_initialize", lambda name: FakeResolver(name, hosts=2))
    with pytest.raises(tpu_lib.TPUSliceError, match="spans 2 hosts"):
        tpu_lib.connect_tpu("local", {}, str(tmp_path))


def test_a_named_slice_records_its_hosts_and_local_data_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(tpu_lib, "_initialize", lambda name: FakeResolver(name, hosts=4))
    resolver = tpu_lib.connect_tpu(None, {"TPU_NAME": "my-pod"}, str(tmp_path))
    assert resolver.tpu == "my-pod" and tpu_lib.slice_hosts({}, str(tmp_path)) == 4
    with pytest.raises(DataError, match="4 hosts.*/data/tfds.*gs://BUCKET"):
        check_data_dir_for_slice("/data/tfds")
    with pytest.raises(DataError, match="TFDS's default"):
        check_data_dir_for_slice(None)
    check_data_dir_for_slice("gs://bucket/tensorflow_datasets")


def test_one_host_reads_local_data():
    check_data_dir_for_slice("/data/tfds", hosts=1)
    check_data_dir_for_slice("/data/tfds")  # no TPU initialised, no TPU VM variables


def test_every_failure_is_listed(monkeypatch, tmp_path):
    def fail(name):
        raise ValueError(f"Could not reach {name}\nmore detail")

    monkeypatch.setattr(tpu_lib, "_initialize", fail)
    root = fake_machine(tmp_path, pci=[V5E])
    with pytest.raises(TPUNotFoundError) as info:
        tpu_lib.connect_tpu(None, {"TPU_NAME": "pod"}, root)
    message = str(info.value)
    assert "(tpu='pod') because TPU_NAME is set" in message and "Could not reach pod" in message
    assert "(tpu='local') because this is a TPU VM (1 TPU chip(s)" in message
    assert "more detail" not in message and tpu_lib.INSTALL_TPU in message


def test_every_printed_install_command_installs_from_the_clone():
    """tfpar is not on PyPI: `pip install "tfpar[tpu]"` fails ("No matching distribution")."""
    import re

    from procs import REPO

    places = [REPO / "README.md", REPO / "docs" / "tpu.md", REPO / "docs" / "troubleshooting.md",
              *(REPO / "tfpar").rglob("*.py"), *(REPO / "colab").glob("*.ipynb")]
    wrong = [f"{path.relative_to(REPO)}: {m.group(0)}" for path in places
             for m in re.finditer(r"pip install [\\\"']*tfpar\b[^\n]{0,20}", path.read_text())]
    assert wrong == []
    assert tpu_lib.INSTALL_TPU == ('pip install -e ".[tpu]" -f '
                                   "https://storage.googleapis.com/libtpu-tf-releases/index.html")


# -- auto ------------------------------------------------------------------------------

def test_auto_falls_back_with_one_line_when_the_tpu_does_not_answer(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tpu_lib, "_initialize", lambda name: (_ for _ in ()).throw(
        RuntimeError("No OpKernel was registered to support Op 'ConfigureDistributedTPU'")))
    root = fake_machine(tmp_path, pci=[V5E])
    kind, _, reason, resolver = factory._auto(None, None, root)  # pylint: disable=protected-access
    assert (kind, resolver) == ("default", None) and "CPU" in reason
    lines = [l for l in capsys.readouterr().out.splitlines() if l]
    assert len(lines) == 1 and "ConfigureDistributedTPU" in lines[0] and "falling back" in lines[0]


def test_auto_uses_the_tpu_that_answers(monkeypatch, tmp_path):
    monkeypatch.setattr(tpu_lib, "_initialize", lambda name: FakeResolver(name))
    root = fake_machine(tmp_path, pci=[V5E])
    kind, _, reason, resolver = factory._auto(None, None, root)  # pylint: disable=protected-access
    assert kind == "tpu" and resolver.tpu == "local" and "1 TPU chip" in reason


def test_auto_does_not_fall_back_from_a_multi_host_slice(monkeypatch, tmp_path):
    root = fake_machine(tmp_path, pci=[V5E] * 4)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1,h2,h3")
    with pytest.raises(tpu_lib.TPUSliceError):
        factory._auto(None, None, root)  # pylint: disable=protected-access


def test_create_strategy_auto_on_this_machine_is_not_a_tpu():
    assert tpu_lib.tpu_candidates(None, {}) == []   # CI machines: no TPU chip, node or variable
    assert isinstance(tfpar.create_strategy("auto"), type(tfpar.create_strategy("default")))


# -- the notebook's install cell ---------------------------------------------------------

def install_cell() -> str:
    import nbformat
    from procs import REPO

    book = nbformat.read(REPO / "colab" / "tpu_keras_fit.ipynb", as_version=4)
    return next(c for c in book.cells if c.cell_type == "code").source


def install_cell_runs(monkeypatch, environ):
    """Executes the TPU notebook's first code cell with pip recorded, not run."""
    import subprocess

    from procs import REPO

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, check: calls.append(args[5:]))
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TFPAR_SOURCE", str(REPO))
    exec(compile(install_cell(), "install-cell", "exec"), {})  # pylint: disable=exec-used
    return calls


def test_the_notebook_installs_nothing_off_a_tpu(monkeypatch, capsys):
    assert install_cell_runs(monkeypatch, {}) == []
    assert "nothing to install" in capsys.readouterr().out


def test_the_notebook_installs_the_tpu_build_on_a_tpu_vm(monkeypatch):
    from procs import REPO

    calls = install_cell_runs(monkeypatch, {"TPU_ACCELERATOR_TYPE": "v5litepod-1"})
    assert calls == [["-e", f"{REPO}[tpu]", "-f", tpu_lib.LIBTPU_INDEX],
                     ["--force-reinstall", "--no-deps", "tensorflow-tpu==2.20.*"]]


# What the cell sees on Colab: the working directory /content holds the clone /content/tfpar,
# a folder without __init__.py that Python imports as an empty namespace package.
CELL_PROLOGUE = """
import json, subprocess
calls, run = [], subprocess.run
subprocess.run = lambda args, check: calls.append(args[5:])
"""
CELL_EPILOGUE = """
subprocess.run = run
import importlib.util, tfpar
found = {"calls": calls, "origin": importlib.util.find_spec("tfpar").origin,
         "version": getattr(tfpar, "__version__", None)}
if CHECK_API:
    found["create_strategy"] = callable(getattr(tfpar, "create_strategy", None))
print(json.dumps(found))
"""


def run_cell_in_clone_folder(tmp_path, *, site: bool, environ=None, check_api=False) -> dict:
    """Runs the install cell in a fresh Python whose working directory holds the clone.

    `site=False` (python -S): no site-packages, so neither tfpar's installed distribution
    nor its editable finder is seen, as on a fresh runtime; pip is recorded, not run.
    """
    import json
    import subprocess
    import sys

    from procs import REPO

    content = tmp_path / "content"
    content.mkdir()
    (content / "tfpar").symlink_to(REPO, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in TPU_ENV + ("PYTHONPATH",)}
    env.update(TFPAR_SOURCE=str(content / "tfpar"), TF_CPP_MIN_LOG_LEVEL="3", **(environ or {}))
    code = CELL_PROLOGUE + install_cell() + CELL_EPILOGUE.replace("CHECK_API", str(check_api))
    done = subprocess.run([sys.executable, *([] if site else ["-S"]), "-c", code], cwd=content,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cell_installs_tfpar_from_the_clone_when_the_folder_shadows_it(tmp_path):
    """The old cell's `find_spec("tfpar") is None` found the clone's folder, installed nothing,
    and the next cell failed: "module 'tfpar' has no attribute 'create_strategy'"."""
    clone = tmp_path / "content" / "tfpar"
    found = run_cell_in_clone_folder(tmp_path, site=False)
    assert found["calls"] == [["-e", str(clone)]]
    assert found["origin"] == str(clone / "tfpar" / "__init__.py") and found["version"]


def test_the_cell_installs_the_tpu_build_editable_from_the_clone_folder(tmp_path):
    clone = tmp_path / "content" / "tfpar"
    found = run_cell_in_clone_folder(tmp_path, site=False, environ={"TPU_ACCELERATOR_TYPE": "v5litepod-1"})
    assert found["calls"] == [["-e", f"{clone}[tpu]", "-f", tpu_lib.LIBTPU_INDEX],
                              ["--force-reinstall", "--no-deps", "tensorflow-tpu==2.20.*"]]
    assert found["origin"] == str(clone / "tfpar" / "__init__.py")


def test_the_next_cell_finds_create_strategy_where_tfpar_is_installed_and_the_clone_shadows_it(tmp_path):
    """tfpar installed (editable, as after a first run): the cell installs nothing, and
    `tfpar.create_strategy` is there although the working directory holds the clone."""
    found = run_cell_in_clone_folder(tmp_path, site=True, check_api=True)
    assert found["calls"] == [] and found["create_strategy"] is True


# -- XLA under TPUStrategy (a stand-in: TPUStrategy's class, one replica on the CPU) ---------

def tpu_stand_in():
    """A TPUStrategy to Keras and tfpar (isinstance, describe: kind 'tpu', 1 replica) whose
    replica runs on the CPU as OneDeviceStrategy's does: what a 1-chip v5e-1 looks like."""
    import tensorflow as tf
    from tensorflow.python.distribute import distribute_lib, one_device_strategy

    class OneHostExtended(one_device_strategy.OneDeviceExtended):
        num_hosts = 1

    class TPUStandIn(tf.distribute.OneDeviceStrategy, tf.distribute.TPUStrategy):
        run = distribute_lib.Strategy.run  # not TPUStrategy's tpu_run

        def __init__(self):  # pylint: disable=super-init-not-called
            distribute_lib.Strategy.__init__(self, OneHostExtended(self, "/cpu:0"))

    return TPUStandIn()


def test_keras_keeps_an_explicit_jit_compile_under_tpu_strategy():
    """Keras 3.15 (trainer.py `compile`) resolves only "auto", to False under any
    strategy; an explicit True stays, so its step, strategy.run included, is jit-compiled."""
    import keras

    strategy = tpu_stand_in()
    assert tfpar.describe(strategy).kind == "tpu" and strategy.num_replicas_in_sync == 1
    for asked, kept in ((True, True), ("auto", False), (False, False)):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", jit_compile=asked)
        assert model.jit_compile is kept, asked


@pytest.mark.parametrize("kind,replicas,jit,said", [
    ("tpu", 1, False, "TPUStrategy"), ("tpu", 8, False, "TPUStrategy"),
    ("mirrored", 2, False, "on 2 replicas"), ("multi_worker_mirrored", 4, False, "on 4 replicas"),
    ("default", 1, True, None), ("one_device", 1, True, None),
])
def test_train_xla_becomes_jit_compile_false_under_tpu_and_several_replicas(kind, replicas, jit, said):
    from tfpar.train import fit_jit_compile

    got, line = fit_jit_compile(True, kind, replicas)
    assert got is jit and (line is None if said is None else said in line and "train.xla" in line)
    assert fit_jit_compile(False, kind, replicas) == (False, None)


def test_the_binary_compiles_fit_without_jit_on_a_one_chip_tpu_and_says_so(tmp_path):
    """train.xla=True (the default) reached compile(jit_compile=True) under TPUStrategy:
    on a 1-chip TPU Keras would run its step in an XLA function on the host (keras#19448)."""
    import runpy

    from procs import REPO
    from tfpar import data as data_lib, run as run_lib

    config = runpy.run_path(str(REPO / "configs" / "reverse_tiny.py"))["get_config"]()
    config.train.steps = 2
    assert config.train.xla and config.mode == "fit"
    strategy, said = tpu_stand_in(), []
    splits = data_lib.load(config.data.name, seq_len=config.data.seq_len, seed=config.seed)
    run = run_lib._Run(config, str(tmp_path), strategy, tfpar.describe(strategy), splits,  # pylint: disable=protected-access
                     said.append, asynchronous=False)
    run_lib.build(run)
    assert run.model.jit_compile is False
    assert [line for line in said if "jit_compile" in line] == [
        run_lib.fit_jit_compile(True, "tpu", 1)[1]]
