"""Hosts that are separate network stacks (network namespaces), for multi-machine tests.

Root only (ip netns, tc): skipped with the reason elsewhere. CI runs as root.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from procs import REPO, SCRIPTS, env
from tfpar.testing.netns import Hosts, HostsError

pytestmark = pytest.mark.skipif(Hosts.unavailable() is not None,
                                reason=Hosts.unavailable() or "")

SINK = ("import socket,sys\ns=socket.socket();s.bind(('0.0.0.0',int(sys.argv[1])));s.listen()\n"
        "c,_=s.accept();n=0\nwhile True:\n d=c.recv(1<<20)\n if not d: break\n n+=len(d)\nprint(n)")
SOURCE = ("import socket,sys\ns=socket.create_connection((sys.argv[1],int(sys.argv[2])),30)\n"
          "s.sendall(b'x'*int(sys.argv[3]));s.close()")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _send(hosts: Hosts, src: int, dst: int, port: int, size: int) -> tuple[int, float]:
    """Bytes received at `dst` and the seconds the transfer took."""
    sink = hosts.popen(dst, [sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE, text=True)
    assert hosts.wait_reachable(src, dst, port, 15)  # (that probe is the sink's one accept)
    sink.wait(15)
    sink = hosts.popen(dst, [sys.executable, "-c", SINK, str(port + 1)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start = time.monotonic()
    hosts.run(src, [sys.executable, "-c", SOURCE, hosts.addresses[dst], str(port + 1), str(size)],
              check=True, timeout=120)
    received = int(sink.communicate(timeout=60)[0])
    return received, time.monotonic() - start


def test_hosts_have_their_own_addresses_a_shaped_rate_and_a_cable_to_pull():
    with Hosts(2, rate="20mbit") as hosts:
        made = {*hosts.names, hosts.switch}
        assert len(set(hosts.addresses)) == 2 and made <= _namespaces()
        for i, address in enumerate(hosts.addresses):  # each host holds its own address only
            shown = hosts.run(i, ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
            assert address in shown and hosts.addresses[1 - i] not in shown
        received, seconds = _send(hosts, 0, 1, 5101, 5 << 20)
        assert received == 5 << 20
        assert 5 * 8 * 1.048576 / seconds < 20 * 1.1  # the tbf rate holds (never faster)
        hosts.link(1, up=False)
        assert not hosts.wait_reachable(0, 1, 5101, timeout=2)
        hosts.link(1, up=True)
    assert not made & _namespaces()  # all removed (other processes' namespaces may come and go)


def test_delay_and_loss_come_from_the_userspace_wire():
    with Hosts(2, delay="100ms", loss="2%") as hosts:
        probe = ("import socket,sys,time\nt=time.monotonic()\n"
                 "s=socket.create_connection((sys.argv[1],int(sys.argv[2])),10)\n"
                 "print(time.monotonic()-t)")
        sink = hosts.popen(1, [sys.executable, "-c", SINK, "5201"], stdout=subprocess.PIPE)
        assert hosts.wait_reachable(0, 1, 5201, 15)
        sink.wait(15)
        sink = hosts.popen(1, [sys.executable, "-c", SINK, "5202"], stdout=subprocess.PIPE)
        time.sleep(0.3)
        rtt = float(hosts.run(0, [sys.executable, "-c", probe, hosts.addresses[1], "5202"],
                              capture_output=True, text=True, check=True).stdout)
        assert 0.19 < rtt < 2.0  # one round trip: 100 ms each way (more if the SYN was lost)
        sink.kill()
        received, _ = _send(hosts, 0, 1, 5203, 1 << 20)
        assert received == 1 << 20  # TCP carries everything across the lossy wire


def test_the_namespaces_go_away_when_the_block_fails():
    hosts = Hosts(3)
    with pytest.raises(RuntimeError, match="boom"):
        with hosts:
            raise RuntimeError("boom")
    assert not {hosts.switch, *(f"tfp{hosts.tag}h{i}" for i in range(3))} & _namespaces()
    with pytest.raises(HostsError, match="loss"):
        Hosts(2, loss="150%")


def test_the_namespaces_go_away_when_the_process_is_terminated():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom tfpar.testing.netns import Hosts\n"
         "with Hosts(2, tag='term') as hosts:\n    print('up', flush=True); time.sleep(60)"],
        env=env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "up"
    assert {"tfptermh0", "tfptermh1"} <= _namespaces()
    holder.terminate()  # e.g. a test timeout
    holder.wait(30)
    assert not {"tfptermsw", "tfptermh0", "tfptermh1"} & _namespaces()


def _tf_config(addresses: list[str], port: int, index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"{a}:{port}" for a in addresses]},
                       "task": {"type": "worker", "index": index}})


def run_workers(hosts: Hosts, script: str, *args: str, port: int = 23456, timeout: float = 420,
                hosts_used: int | None = None) -> list[subprocess.CompletedProcess]:
    """Runs tests/scripts/SCRIPT as worker i on host i with a TF_CONFIG of host addresses."""
    count = hosts_used or hosts.n
    procs = [hosts.popen(i, [sys.executable, str(SCRIPTS / script), *args], cwd=REPO,
                         env=env(TF_CONFIG=_tf_config(hosts.addresses[:count], port, i)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:  # every pipe read at once:
        outs = list(pool.map(lambda p: p.communicate(timeout=timeout)[0], procs))  # a full one stalls its worker
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]


def _assert_like_one_process(tmp_path, results, count: int, names=("worker", "loop")) -> None:
    """Every worker ran; fit's and the loop's weights equal one process's to 1e-5, and the
    replicas are bit-identical."""
    import tensorflow as tf
    from scripts import fit_model

    for result in results:
        assert result.returncode == 0, result.stdout[-3000:]
    reference, _ = fit_model.train(tf.distribute.get_strategy(), fit_model.initial_weights())
    for name in names:
        files = [np.load(tmp_path / f"{name}{i}.npz") for i in range(count)]
        workers = [[f[f"arr_{i}"] for i in range(len(f.files))] for f in files]
        for weights in workers[1:]:
            for a, b in zip(workers[0], weights):
                np.testing.assert_array_equal(a, b)  # the replicas never drift apart
        for actual, expected in zip(workers[0], reference):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _initial_weights(tmp_path) -> str:
    from scripts import fit_model

    path = tmp_path / "init.npz"
    np.savez(path, **{f"w{i}": w for i, w in enumerate(fit_model.initial_weights())})
    return str(path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fit_and_loop_across_4_hosts_match_one_process(tmp_path):
    """One worker per host; 4 hosts share this machine's 2 cores: correctness only. (2 hosts:
    the stranger test below, which also checks fit and the loop against one process.)"""
    with Hosts(4, rate="1gbit") as hosts:
        results = run_workers(hosts, "fit_worker.py", _initial_weights(tmp_path), str(tmp_path))
    _assert_like_one_process(tmp_path, results, 4)
    assert all("FIXED_FIT: ok" in r.stdout for r in results)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stranger_sending_garbage_to_a_worker_does_not_disturb_training(tmp_path):
    """Fit and the loop across 2 hosts equal one process, while a host outside the cluster
    sends garbage to worker 0's port: TensorFlow's gRPC server listens on every interface
    (0.0.0.0) whatever TF_CONFIG says, so the stranger reaches it, and gRPC's framing refuses
    the bytes."""
    noise = ("import os,socket,sys,time\nend=time.time()+float(sys.argv[3]);sent=0\n"
             "while time.time()<end:\n"
             "  try:\n    s=socket.create_connection((sys.argv[1],int(sys.argv[2])),1)\n"
             "    s.sendall(os.urandom(65536)+b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n'+os.urandom(4096))\n"
             "    s.close();sent+=1\n  except OSError: pass\n  time.sleep(0.05)\nprint(sent)")
    init = _initial_weights(tmp_path)
    with Hosts(2) as hosts:
        outsider = hosts.stranger()
        attack = hosts.popen(outsider, [sys.executable, "-c", noise, hosts.addresses[0], "23456", "30"],
                             stdout=subprocess.PIPE, text=True)
        results = run_workers(hosts, "fit_worker.py", init, str(tmp_path))
        delivered = int(attack.communicate(timeout=60)[0])
    assert delivered > 0  # the outsider did reach the worker's port with its garbage
    _assert_like_one_process(tmp_path, results, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_200ms_latency_and_1pct_loss_give_the_clean_links_weights(tmp_path):
    """tfpar's loop only (fit crosses the same collectives; the clean-link tests cover it)."""
    init = _initial_weights(tmp_path)
    with Hosts(2, delay="200ms", loss="1%") as hosts:
        results = run_workers(hosts, "fit_worker.py", init, str(tmp_path), "loop")
    _assert_like_one_process(tmp_path, results, 2, names=("loop",))


def _train_args(workdir, steps: int = 200, checkpoint_every: int = 100) -> list[str]:
    return ["-m", "tfpar.train", "--config=configs/reverse_tiny.py",
            "--config.strategy=multi_worker_mirrored", f"--config.train.steps={steps}",
            f"--config.train.checkpoint_every={checkpoint_every}", "--config.train.log_every=20",
            "--config.strategy_args.timeout_s=20", "--config.strategy_args.connect_timeout_s=30",
            f"--workdir={workdir}"]


def _start_binary(hosts: Hosts, workdir, count: int, port: int = 23456,
                  steps: int = 200, checkpoint_every: int = 100) -> list[subprocess.Popen]:
    return [hosts.popen(i, [sys.executable, *_train_args(workdir, steps, checkpoint_every)], cwd=REPO,
                        env=env(TF_CONFIG=_tf_config(hosts.addresses[:count], port, i)),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(count)]


def _wait_for_file(path, procs, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_host_gone_for_good_stops_its_peer_in_time_and_the_rest_resume(tmp_path):
    with Hosts(2) as hosts:
        procs = _start_binary(hosts, tmp_path, 2)
        _wait_for_file(tmp_path / "checkpoints" / "ckpt-100.index", procs, timeout=400)
        hosts.link(1, up=False)  # host 1 is gone: no reset, no answer, just silence
        pulled = time.monotonic()
        out, _ = procs[0].communicate(timeout=120)
        detected = time.monotonic() - pulled
        assert procs[0].returncode not in (0, None), out[-2000:]
        # the 20 s collective timeout stops it, plus the step in flight and the exit: 35.5 s once
        # on a loaded CI machine; without the timeout a collective waits for good (and the
        # communicate above would time out at 120 s)
        assert detected < 20 + 40, detected
        last = [line for line in out.splitlines() if line.startswith("tfpar-train:")]
        assert last and "stopped answering" in last[-1], out[-2000:]
        assert f"(worker 1 at {hosts.addresses[1]}:23456) stopped answering" in last[-1], last[-1]

        # The remaining host alone: it resumes from the chief's checkpoint at its exact step.
        alone = _start_binary(hosts, tmp_path, 1)[0]
        out, _ = alone.communicate(timeout=400)
    assert alone.returncode == 0, out[-3000:]
    assert "ckpt-100" in out and (tmp_path / "checkpoints" / "ckpt-200.index").exists()


def _checkpoint_values(prefix) -> dict:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(prefix))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if "model_weights" in key or "optimizer" in key}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_link_down_for_20s_ends_with_the_uninterrupted_weights(tmp_path):
    """The cable of host 1 is out for 20 s mid-run. Each host runs the same tfpar-launch
    command (--hosts, its --node-rank, --max-restarts 2): the group rides through, or fails
    within the collective timeout naming the peer and is restarted on every node; either way
    it ends with the weights of a run that was never interrupted."""
    steps = ["--config.train.steps=60", "--config.train.checkpoint_every=20",
             "--config.train.steps_per_loop=10", "--config.train.log_every=10"]

    def start(hosts, workdir):
        launch = ["-m", "tfpar.launch", "--hosts", ",".join(hosts.addresses), "--max-restarts", "2"]
        return [hosts.popen(i, [sys.executable, *launch, "--node-rank", str(i), "--", sys.executable,
                                *_train_args(workdir), *steps], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(2)]

    with Hosts(2) as hosts:
        for proc in start(hosts, tmp_path / "clean"):
            out, _ = proc.communicate(timeout=400)
            assert proc.returncode == 0, out[-2000:]

        cut = tmp_path / "cut"
        procs = start(hosts, cut)
        _wait_for_file(cut / "checkpoints" / "ckpt-20.index", procs, timeout=400)
        hosts.link(1, up=False)
        time.sleep(20)
        hosts.link(1, up=True)
        outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:]
    if "the group failed" in outs[0]:
        assert "(worker 1 at" in outs[0] and "stopped answering" in outs[0], outs[0][-3000:]
        print("link down 20 s: failed, named the peer, restarted by tfpar-launch, resumed")
    else:
        print("link down 20 s: rode through")
    clean, resumed = _checkpoint_values(tmp_path / "clean/checkpoints/ckpt-60"), \
        _checkpoint_values(cut / "checkpoints" / "ckpt-60")
    assert clean.keys() == resumed.keys() and clean
    for key in clean:
        np.testing.assert_allclose(resumed[key], clean[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_started_on_one_host_resumes_on_two_at_its_exact_step(tmp_path):
    with Hosts(2) as hosts:
        alone = hosts.popen(0, [sys.executable, *_train_args(tmp_path, steps=20, checkpoint_every=20)],
                            cwd=REPO, env=env(TF_CONFIG=_tf_config(hosts.addresses[:1], 23456, 0)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = alone.communicate(timeout=400)
        assert alone.returncode == 0, out[-2000:]
        procs = _start_binary(hosts, tmp_path, 2, steps=40, checkpoint_every=20)  # on both hosts
        outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:]
    assert "resuming from step 20" in outs[0]  # the chief says it; both restore the same file
    assert (tmp_path / "checkpoints" / "ckpt-40.index").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hybrid_over_hosts_x_pipeline_on_each_hosts_cpus(tmp_path):
    """Data parallel over 2 hosts (multi_worker_mirrored, one replica each) x a 2-stage
    pipeline on each host's 2 logical CPUs. Uncompressed, it equals one device; with
    TopK(0.1) (lossy: error feedback, an all-gather across hosts) it equals the same
    compression on the same 2 x 2 hybrid inside one process, which is what a lossy run can
    be held to. Every variable and momentum slot is on its host's stage CPU, and the placer's
    log puts every matrix product of a stage, forward and backward, there too."""
    import json
    import re

    import keras
    import tensorflow as tf
    from scripts import hybrid_worker

    from tfpar import placement

    keras.utils.set_random_seed(0)
    template = hybrid_worker.small_gpt()
    template.build((None, hybrid_worker.SEQ))
    initial = template.get_weights()
    np.savez(tmp_path / "init.npz", **{f"w{i}": w for i, w in enumerate(initial)})
    with Hosts(2, rate="1gbit") as hosts:
        results = run_workers(hosts, "hybrid_worker.py", str(tmp_path / "init.npz"), str(tmp_path))
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]  # all each worker printed
    for result, log in zip(results, logs):
        assert result.returncode == 0, log[-3000:]

    template.set_weights(initial)  # one device, uncompressed
    hybrid_worker.train(template, tf.distribute.get_strategy())
    plan = placement.balanced(template, ["/cpu:0", "/cpu:1"]).replicate(
        ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])  # the same 2 x 2 hybrid in this process
    with plan.scope() as strategy:
        local = hybrid_worker.small_gpt()
        local.build((None, hybrid_worker.SEQ))
    local.set_weights(initial)
    hybrid_worker.train(local, strategy, placement.Pipeline(local, plan, micro_batches=2, schedule="1f1b"),
                        topk=hybrid_worker.RUNS["topk"])
    references = {"none": template.get_weights(), "topk": local.get_weights()}
    for run, reference in references.items():
        files = [np.load(tmp_path / f"{run}_{i}.npz") for i in range(2)]
        workers = [[f[f"arr_{i}"] for i in range(len(f.files))] for f in files]
        for a, b in zip(*workers):
            np.testing.assert_array_equal(a, b)  # both hosts apply the same sum
        for actual, expected in zip(workers[0], reference):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=run)
    lossy = max(np.abs(a - b).max() for a, b in zip(references["topk"], references["none"]))
    assert lossy > 1e-3  # TopK(0.1) really changed the updates: the check above is not trivial

    def on_cpu(task: int, device: str) -> str:  # "/cpu:1" on host `task`, as TensorFlow names it
        return f"/job:worker/replica:0/task:{task}/device:CPU:{tf.DeviceSpec.from_string(device).device_index}"

    for task, log in enumerate(logs):
        placed = [json.loads(line[7:]) for line in log.splitlines() if line.startswith("PLACED ")]
        assert [p["run"] for p in placed] == list(hybrid_worker.RUNS) and placed[0]["replicas"] == 2
        for p in placed:
            for v in p["variables"]:
                assert v["device"] == v["slot"] == on_cpu(task, v["stage"]), (p["run"], v)
        products = re.findall(r"^(\S+): \((?:MatMul|BatchMatMulV2|Einsum)\): (\S+)$", log, re.M)
        for stage, layer in placed[0]["layers"].items():
            if stage == "embed":
                continue  # a gather, no matrix product
            mine = [(name, device) for name, device in products if re.search(rf"/{layer}_\d+/", name)]
            assert any("gradient_tape" in n for n, _ in mine) and any("gradient_tape" not in n for n, _ in mine)
            assert {device for _, device in mine} == {on_cpu(task, placed[0]["stages"][stage])}, (task, stage)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_diloco_through_the_binary_over_a_20_mbit_link_resumes_at_its_step(tmp_path):
    """Two hosts on a 20 Mbit/s link train reverse_tiny with `parallel.sync=diloco` (rounds
    of 5 steps, the model in 2 fragments, int4 outer gradients, each exchange beside the
    next 2 steps) to step 11, with fragment 0's round (ended at 10) in flight, each worker
    writing its own copies beside the checkpoint, then resume to step 20 from step 11."""
    args = ["--config.mode=loop", "--config.parallel.sync=diloco", "--config.parallel.inner_steps=5",
            "--config.parallel.outer_compression=int4", "--config.parallel.overlap_steps=2",
            "--config.parallel.fragments=2"]

    def run(steps):
        procs = [hosts.popen(i, [sys.executable, *_train_args(tmp_path, steps=steps, checkpoint_every=10), *args],
                             cwd=REPO, env=env(TF_CONFIG=_tf_config(hosts.addresses, 23456, i)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-2000:]
        return outs

    with Hosts(2, rate="20mbit") as hosts:
        first = run(11)
        assert "DiLoCo: 5 local steps per round" in first[0] and "each exchange beside the next 2 steps, the model in 2 fragments" in first[0]
        for task in ("worker-0", "worker-1"):
            assert (tmp_path / "checkpoints" / "workers" / task / "ckpt-11.index").exists()
        second = run(20)
    assert "resuming from step 11" in second[0]
    assert (tmp_path / "checkpoints" / "ckpt-20.index").exists()
    assert (tmp_path / "checkpoints" / "workers" / "worker-1" / "ckpt-20.index").exists()
