"""Bytes on the wire per phase: the progress line names the phase a window's steps were in
and weighs each phase by its steps; the start line lists every phase; the end shows the
run's average ratio (float32 bytes / bytes sent over the steps this run trained)."""

import json
import re
import runpy

import pytest

from procs import REPO
from tfpar import callbacks
from tfpar.callbacks import ProgressLine, WirePhase, wire_start_line

# A float32 warm-up of 10 steps (1,000 bytes a step), then 20 bytes a step (50x).
SCHEDULE = [WirePhase("warmup", 0, 1_000, 1_000), WirePhase("compressed", 10, 20, 1_000)]


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for the progress line: `clock.now` seconds, moved by the test."""
    class Clock:
        now = 0.0
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: Clock.now)
    return Clock


def reports(clock, steps, start=0, total=20, wire=SCHEDULE):
    """(line, values) of a report at each of `steps`, two seconds apart, from `start`."""
    lines = []
    progress = ProgressLine(total, wire=wire, say=lines.append)
    progress.start(start)
    out = []
    for step in steps:
        clock.now += 2.0
        values = progress.report(step, loss=1.0)
        out.append((lines[-1], values))
    return out


def test_each_window_names_its_phase_and_weighs_a_boundary_by_its_steps(clock):
    (warm, warm_v), (mixed, mixed_v), (done, done_v) = reports(clock, [5, 15, 20])
    assert "| wire warmup 2.5 kB/s (1.0x) |" in warm  # 5 steps x 1,000 B in 2 s
    assert warm_v["wire_bytes_per_s"] == 2_500 and warm_v["compression_ratio"] == 1.0
    assert warm_v["wire_phase"] == 0 and warm_v["wire_bytes_per_step"] == 1_000
    # steps 5..14: 5 warm-up steps (1,000 B) and 5 compressed (20 B)
    assert mixed_v["wire_bytes_per_s"] == (5 * 1_000 + 5 * 20) / 2
    assert mixed_v["compression_ratio"] == pytest.approx(10_000 / 5_100)
    assert mixed_v["wire_phase"] == 1 and mixed_v["wire_bytes_per_step"] == 510
    assert "| wire warmup->compressed 2.5 kB/s (2.0x) |" in mixed
    assert "| wire compressed 50 B/s (50x) |" in done and done_v["compression_ratio"] == 50
    assert "run" not in warm and "run" not in mixed


def test_the_last_line_gives_the_run_total_and_its_average_ratio(clock):
    (_, _), (done, values) = reports(clock, [10, 20])
    sent = 10 * 1_000 + 10 * 20
    assert values["wire_bytes_sent"] == sent
    assert values["run_compression_ratio"] == pytest.approx(20 * 1_000 / sent)  # 1.96, not 50
    assert "| run 10.2 kB sent (2.0x) |" in done


def test_a_resumed_run_counts_only_the_steps_it_trained(clock):
    [(done, values)] = reports(clock, [20], start=15)
    assert values["wire_bytes_sent"] == 5 * 20 and values["run_compression_ratio"] == 50
    assert "| wire compressed 50 B/s (50x) | run 100 B sent (50x) |" in done


def test_one_phase_keeps_the_short_line(clock):
    [(done, values)] = reports(clock, [20], wire=[WirePhase("topk", 0, 20, 1_000)])
    assert "| wire 200 B/s (50x) | run 400 B sent (50x) |" in done and values["wire_phase"] == 0


def test_the_start_line_lists_every_phase_with_its_first_step():
    assert wire_start_line(SCHEDULE, "powersgd", 20) == (
        "wire: per replica per step, warmup 1,000 B (1.0x) from step 0, compressed 20 B (50x) "
        "from step 10; run average 2.0x (powersgd)")
    assert wire_start_line(SCHEDULE[1:], "topk", 20) == (
        "wire: 20 bytes per replica per step, 50.0x fewer than float32 (topk)")


@pytest.mark.slow  # 45 s on 2 shared cores (two traces of the step, and the eval's)
def test_a_powersgd_run_with_a_warmup_reports_each_phase_and_its_average(tmp_path, capsys, monkeypatch):
    """The binary on the 4 logical CPUs: 4 float32 steps, then 4 PowerSGD steps; reports at
    3 (warm-up), 6 (across the boundary), 8 (compressed, the run's total). One trace per
    phase: the bytes are counted from the traces training runs."""
    from tfpar.loop import trainer as trainer_lib
    from tfpar.train import train_and_evaluate

    traced = []
    original = trainer_lib.Trainer._train_loop_fn

    def counting(self, iterator, steps, phase=None):
        traced.append(phase)
        return original(self, iterator, steps, phase)

    monkeypatch.setattr(trainer_lib.Trainer, "_train_loop_fn", counting)
    config = runpy.run_path(str(REPO / "configs" / "reverse_tiny.py"))["get_config"]()
    config.mode, config.strategy, config.compression = "loop", "mirrored", "powersgd"
    config.compression_args.warmup_steps = 4
    config.train.update(steps=8, steps_per_loop=4, log_every=3, checkpoint_every=8, eval_examples=100)
    results = train_and_evaluate(config, str(tmp_path))
    out = capsys.readouterr().out

    start = re.search(r"^wire: per replica per step, warmup ([\d,]+) B \(1\.0x\) from step 0, "
                      r"compressed ([\d,]+) B \(([\d.]+)x\) from step 4; run average ([\d.]+)x", out, re.M)
    assert start, out
    warm, compressed = (int(start[i].replace(",", "")) for i in (1, 2))
    lines = re.findall(r"^step (\d)/8 .*\| wire (\S+) \S+ \S+ \(([\d.]+)x\)(.*)$", out, re.M)
    assert [(step, phase, ratio) for step, phase, ratio, _ in lines] == [
        ("3", "warmup", "1.0"), ("6", "warmup->compressed", lines[1][2]), ("8", "compressed", start[3])]
    assert float(start[3]) > 3 and 1 < float(lines[1][2]) < float(start[3])

    fp32 = 4 * int(re.search(r"^model: gpt, ([\d,]+) parameters", out, re.M)[1].replace(",", ""))
    sent = 4 * warm + 4 * compressed
    assert results["wire_bytes_sent"] == sent and results["wire_bytes_per_step"] == sent / 8
    assert results["compression_ratio"] == pytest.approx(8 * fp32 / sent)
    assert f"run {float(start[4]):.1f}x" in f"run {results['compression_ratio']:.1f}x"
    assert f"({results['compression_ratio']:.1f}x) |" in lines[2][3]  # "| run 2.2 MB sent (1.8x)"
    assert json.loads((tmp_path / "results.json").read_text())["compression_ratio"] == results["compression_ratio"]
    assert sorted(traced) == ["compressed", "warmup"]  # the counting traced nothing more
