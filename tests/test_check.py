"""tfpar-check on CPU: one device, mirrored on logical CPUs, two workers under tfpar-launch.

Small sizes (--small) so it runs in CI; the numbers are measured, never asserted."""

import json
import sys

import pytest

from procs import run_python
from tfpar import check, check_probes
from tfpar.launch import free_ports


def run_check(*args, timeout=400):
    result = run_python(["-m", "tfpar.check", "--json", "--small", *args], timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_ready(report, replicas):
    assert report["verdict"].startswith("READY"), report["verdict"]
    assert report["strategy"]["replicas"] == replicas
    assert report["keras_fixes"]["applied"]
    assert report["fit_vs_loop"]["equal"] and report["fit_vs_loop"]["max_difference"] <= 1e-5
    assert [row["bytes"] for row in report["all_reduce"]] == list(check.SMALL_SIZES)
    assert all(row["time_us"] > 0 for row in report["all_reduce"])
    assert {row["dtype"] for row in report["matmul"]} == {"float32", "bfloat16"}
    for key in ("python", "tensorflow", "keras", "tfpar"):
        assert report["versions"][key]


def test_one_device_with_auto():
    report = run_check()
    assert report["strategy"]["name"] == "default" and "no TPU, cluster or GPU" in report["strategy"]["why"]
    assert report["cluster"] is None and report["devices"]["cpu_cores"] >= 1
    assert_ready(report, replicas=1)


@pytest.mark.slow
def test_mirrored_on_logical_cpus_measures_the_bus_bandwidth():
    report = run_check("--strategy=mirrored", "--virtual-devices=2")
    assert_ready(report, replicas=2)
    assert all(row["busbw_gbs"] > 0 for row in report["all_reduce"])
    assert len(report["matmul"]) == 4  # 2 devices x 2 dtypes


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_workers_under_tfpar_launch():
    result = run_python(["-m", "tfpar.launch", "--workers", "2", "--", sys.executable, "-m",
                         "tfpar.check", "--json", "--small"], timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    reports = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("[worker:") and "] {" in line]
    assert len(reports) == 2
    for report in reports:
        assert report["strategy"]["name"] == "multi_worker_mirrored"
        assert "TF_CONFIG lists 2 workers" in report["strategy"]["why"]
        assert report["cluster"]["preflight"] == "all 1 peer(s) answered"
        assert_ready(report, replicas=2)


def test_text_report_ends_with_the_verdict():
    report = {"versions": {"python": "3", "tensorflow": "2", "keras": "3", "tfpar": "0"},
              "problems": [], "warnings": ["fixes off"], "cluster": None,
              "strategy": {"name": "default", "why": "the CPU", "replicas": 1},
              "all_reduce": [{"bytes": 4096, "time_us": 10.0, "algbw_gbs": 0.4, "busbw_gbs": 0.0}]}
    text = check.render(report)
    assert "busbw (GB/s)" in text and "cluster    none (one process)" in text
    assert text.splitlines()[-1] == "READY with warnings (default x1): fixes off"
    report["problems"].append("peer worker[1] unreachable")
    assert check.verdict(report).startswith("NOT READY (default x1): peer worker[1]")


def test_an_unreachable_peer_is_not_ready():
    own, peer = free_ports(2)  # nobody listens on the peer's port
    cluster = json.dumps({"cluster": {"worker": [f"127.0.0.1:{own}", f"127.0.0.1:{peer}"]},
                          "task": {"type": "worker", "index": 0}})
    result = run_python(["-m", "tfpar.check", "--json", "--small", "--connect-timeout=1"],
                        timeout=120, TF_CONFIG=cluster)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["verdict"].startswith("NOT READY") and "worker[1]" in report["verdict"]


def test_a_keras_backend_other_than_tensorflow_is_not_ready_by_name():
    result = run_python(["-m", "tfpar.check", "--json", "--small"], timeout=120, KERAS_BACKEND="jax")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["verdict"].startswith("NOT READY") and "set to 'jax' (KERAS_BACKEND=jax)" in report["verdict"]
    assert report["versions"]["keras"]  # read from its metadata: importing it would fail


def test_versions_name_the_tpu_build_and_libtpu(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    fake = {"tensorflow-tpu": "2.20.0", "libtpu-nightly": "0.1.dev20240101"}

    def version(name):
        if name in fake:
            return fake[name]
        if name == "libtpu":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    found = check.versions()
    assert (found["tensorflow_tpu"], found["libtpu"]) == ("2.20.0", "libtpu-nightly 0.1.dev20240101")
    report = {"versions": found, "problems": [], "warnings": [], "cluster": None,
              "strategy": {"name": "tpu", "why": "TPU VM", "replicas": 1}}
    assert "(tensorflow-tpu 2.20.0, libtpu-nightly 0.1.dev20240101)" in check.render(report).splitlines()[0]


def test_the_matmul_rows_time_ten_products_and_say_what_math_they_measure(monkeypatch):
    import tensorflow as tf

    rows = check_probes.matmul_throughput(["/cpu:0"], 64, 10)
    assert [(r["math"], r["n"], r["iterations"]) for r in rows] == [("float32", 64, 10), ("bfloat16", 64, 10)]
    assert check.Options().matmul_iterations >= 10
    monkeypatch.setattr(check_probes, "_tf32_applies", lambda: True)  # a GPU of compute capability >= 8.0
    maths = [(dtype.name, math, tf32) for dtype, math, tf32 in check_probes._matmul_rows("/device:GPU:0")]  # pylint: disable=protected-access
    assert maths == [("float32", "float32 (TF32 math: TensorFlow's default on this GPU)", None),
                     ("float32", "float32 (TF32 off for this row)", False), ("bfloat16", "bfloat16", None)]
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    with check_probes._tf32(not before):  # pylint: disable=protected-access
        assert tf.config.experimental.tensor_float_32_execution_enabled() is (not before)
    assert tf.config.experimental.tensor_float_32_execution_enabled() is before


def test_the_check_runs_in_process_and_says_ready(capsys):
    """tfpar-check's whole path in this process (the default strategy of the test process):
    versions, devices, all-reduce table, matmul rows, one GPT step in fit and the loop."""
    import json

    import pytest

    with pytest.raises(SystemExit) as done:
        check.run(["--strategy=default", "--small", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done.value.code == 0 and report["verdict"].startswith("READY"), report
    assert report["fit_vs_loop"]["equal"] and report["all_reduce"] and report["matmul"]
