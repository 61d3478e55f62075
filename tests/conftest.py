"""Test set-up: the CPU is split into 4 logical devices before TensorFlow starts.

Multi-replica strategies then run on one CPU (replicas share cores). Tests that need a
fresh TensorFlow (multi-worker, start-up errors) run in subprocesses; see `procs.py`.

Two tiers: `python -m pytest` runs everything (CI, .ci/run); `python -m pytest -m "not
slow"` is the fast tier for everyday work. A test is slow when it is marked `slow` or
`multiprocess` in its file, or listed in SLOW below (measured with `--durations` on 2
shared cores: each takes more than ~20 s there), so the list lives in one place.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.strategy import runtime  # noqa: E402  (must run before TensorFlow starts)

LOGICAL_CPUS = 4
runtime.split_devices(LOGICAL_CPUS)


def _record_traced_calls(path: str) -> None:
    """TFPAR_CALLS_FILE=PATH: note every tfpar function that code traced by tf.function calls.
    AutoGraph runs a converted copy of traced code, which coverage cannot see;
    tests/public_coverage.py reads these notes beside coverage's data."""
    import atexit
    import inspect

    from tensorflow.python.autograph.impl import api

    seen, original = set(), api.converted_call

    def converted_call(f, args, kwargs, caller_fn_scope=None, options=None):
        target = f.__func__ if inspect.ismethod(f) else f  # no attribute read on other objects
        if not inspect.isfunction(target):
            target = getattr(type(f), "__call__", None)
        if inspect.isfunction(target) and (target.__module__ or "").startswith("tfpar"):
            seen.add(f"{target.__module__}.{target.__qualname__}")
        return original(f, args, kwargs, caller_fn_scope, options)

    api.converted_call = converted_call  # before the first conversion copies api's namespace
    atexit.register(lambda: open(f"{path}.{os.getpid()}", "w").write("\n".join(sorted(seen))))


if os.environ.get("TFPAR_CALLS_FILE"):
    _record_traced_calls(os.environ["TFPAR_CALLS_FILE"])

# Files whose every test is slow, then single tests (node ids without parameters).
SLOW_FILES = (
    "tests/faults/test_kill_and_restart.py",   # two-worker jobs killed and restarted
    "tests/test_notebooks.py",                 # runs the Colab notebooks end to end
    "tests/test_configs.py",                   # every config file, a few steps each
)
SLOW = (
    "tests/test_train_binary.py::test_reverse_task_reaches_100_percent_and_writes_the_workdir",
    "tests/test_train_binary.py::test_resume_at_an_odd_step_continues_with_the_same_weights",
    "tests/test_train_binary.py::test_intervals_that_do_not_divide_land_on_their_steps",
    "tests/test_loop.py::test_mixed_precision_trains_the_reverse_task_to_100_percent",
    "tests/test_compression.py::test_compressed_runs_learn_the_task_like_the_uncompressed_one",
    "tests/faults/test_checkpoint_faults.py::test_a_kill_while_saving_leaves_the_previous_checkpoint_restorable",
    # measured with --durations (fast tier, load average 8-12 on the 2 shared cores): 21-112 s
    "tests/test_any_model.py::test_the_loop_with_compression_trains_any_model",
    "tests/test_any_model.py::test_fit_with_the_injected_strategy_gives_one_device_numbers",
    "tests/test_loop.py::test_loop_matches_keras_fit",
    "tests/test_compression.py::test_none_equals_the_plain_loop_bit_for_bit",
    "tests/faults/test_nonfinite.py::test_skip_leaves_out_exactly_the_bad_update",
    "tests/faults/test_checkpoint_faults.py::test_a_checkpoint_from_two_replicas_restores_under_four_and_under_one_device",
    "tests/test_fit_equivalence.py::test_fit_matches_one_device",
    # second measurement (load average 2-4): 15-32 s each, moved to keep the tier under 4 min
    "tests/test_loop.py::test_accumulating_k_batches_equals_one_k_times_larger_batch",
    "tests/test_loop.py::test_mixed_precision_under_mirrored_matches_one_device",
    "tests/test_loop.py::test_global_norm_clipping_equals_the_one_device_clip",
    "tests/test_placement.py::test_placement_read_from_the_executed_graphs",
    # third measurement, after the issue branches merged (load average 1-2): 7.5-17.5 s each
    "tests/test_loop.py::test_the_callers_optimizer_still_clips_and_synchronises_after_the_trainer",
    "tests/test_loop.py::test_loss_scaling_changes_nothing_but_the_scale",
    "tests/test_compression_dgc.py::test_dgc_density_one_is_sgd_with_momentum",
    "tests/test_compression_onebit.py::test_warmup_is_keras_adam_with_global_clipping",
    "tests/test_compression.py::test_fp16_stays_within_fp16_rounding",
    "tests/test_check.py::test_one_device_with_auto",
    "tests/test_check.py::test_an_unreachable_peer_is_not_ready",
    "tests/test_preflight.py::test_create_strategy_with_a_dead_peer_fails_fast_and_names_it",
    # single parameter sets (node ids with parameters); the others stay in the fast tier
    "tests/test_placement.py::test_pipeline_loss_and_gradients_equal_the_unsplit_model[1f1b-4-True-2]",
    # the hybrid with topk: the one without keeps the fast tier's pipelined Trainer under a plan's strategy
    "tests/test_placement.py::test_hybrid_two_replicas_of_a_two_stage_pipeline_train_like_one_device[topk]",
    # 26 s: the mid_round parameter keeps the fast tier's DiLoCo resume (2026-12-07, for the profiling tests)
    "tests/test_diloco.py::test_a_run_stopped_mid_round_resumes_onto_the_uninterrupted_run[in_flight_int4]",
    *(f"tests/faults/test_nonfinite.py::test_skip_with_compression_leaves_its_state_as_before_the_bad_step[{name}]"
      for name in ("powersgd", "dgc", "onebit_adam", "dgc_adam", "onebit_adam_every2")),  # 8-12 s each
)


def pytest_collection_modifyitems(config, items):
    """Marks the slow tests (see the module docstring) without editing their files."""
    for item in items:
        path = os.path.relpath(str(item.path), str(config.rootpath)).replace(os.sep, "/")
        node = f"{path}::{item.originalname}"
        with_parameters = f"{path}::{item.name}"
        if (item.get_closest_marker("multiprocess") or path in SLOW_FILES or node in SLOW
                or with_parameters in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def without_grappler():
    """Grappler (TensorFlow's graph optimizer) off for this test: a large traced graph (a
    pipeline of 4 stages x 8 micro-batches) is instantiated about twice as fast, and numbers
    do not depend on it. Tests of order, placement or timing keep it on."""
    import tensorflow as tf

    before = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    yield
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before})


# reverse_tiny on 2 replicas through the binary, CONVERGENCE_STEPS each: one process trains
# them all. The warm-ups end at step 60 (DGC's density, 1-bit Adam's freeze); PowerSGD starts
# compressing at 20 (after a float32 or an fp16 start) and drops from rank 8 to 4 at 120.
CONVERGENCE_STEPS = 200
CONVERGENCE_RUNS = {
    "none": "none", "topk": "topk", "powersgd": "powersgd", "int8": "int8", "sign": "sign",
    # dgc: the config's SGD (momentum 0.9, nesterov, clip_norm 1.0, weight decay) moves into it
    "dgc": "dgc:compression_args.ratio=0.01;compression_args.sparsity_warmup_steps=60;"
           "optimizer.name=sgd;optimizer.learning_rate=0.3",
    # onebit_adam and dgc_adam: the config's AdamW (beta_2 0.98, clip_norm 1.0, weight decay) moves in
    "onebit_adam": "onebit_adam:compression_args.freeze_step=60",
    "onebit_adam_every2": "onebit_adam:compression_args.freeze_step=60;"
                          "compression_args.exchange_every=2;compression_args.embeddings=True",
    "dgc_adam": "dgc_adam:compression_args.ratio=0.01;compression_args.freeze_step=60",
    "powersgd_schedule": "powersgd:compression_args.rank_schedule=8@0,4@100;compression_args.warmup_steps=20",
    "powersgd_fp16_start": "powersgd:compression_args.rank_schedule=8@0,4@100;compression_args.warmup_steps=20;"
                           "compression_args.warmup_compression=fp16",
    "powersgd_bf16": "powersgd:compression_args.rank_schedule=8@0,4@100;compression_args.warmup_steps=20;"
                     "compression_args.factor_dtype=bfloat16",
}


@pytest.fixture(scope="session")
def reverse_task_runs(tmp_path_factory) -> dict:
    """name -> results.json of CONVERGENCE_RUNS, trained once for the convergence tests of
    test_compression.py and test_compression_dgc.py (one process: TensorFlow starts once).
    Its users carry `xdist_group("convergence")`: one pytest-xdist worker runs them all."""
    import json

    from procs import SCRIPTS, run_python

    workdir = tmp_path_factory.mktemp("convergence")
    done = run_python([str(SCRIPTS / "compression_convergence.py"), str(workdir),
                       str(CONVERGENCE_STEPS), *CONVERGENCE_RUNS.values()], timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(CONVERGENCE_RUNS), done.stdout[-3000:]
    return dict(zip(CONVERGENCE_RUNS, results))
