"""The combination matrix: switch strategy, precision, compressor or optimizer option and
get the numbers you would get without the switch, or a refusal at start that names the
combination and what to use instead.

Axes (tests/matrix_cases.py): strategy (default = one device; mirrored on 2 logical CPUs;
multi_worker_mirrored = 2 worker processes on loopback) x mode (Keras `fit`, compression
through `compress_fit`; tfpar's loop, `tfpar.Trainer`) x precision (float32,
mixed_bfloat16, mixed_float16: `compile` wraps the optimizer in a LossScaleOptimizer for
fit, the loop gets `LossScaleOptimizer(optimizer)` as the binary's compile makes it; the
policy is back to float32 after every run) x compressor (none, fp16, int8, topk, powersgd,
sign, dgc, onebit_adam, dgc_adam) x option (none, global_clipnorm, clipnorm, clipvalue,
gradient_accumulation_steps=2, use_ema, AdamW's weight_decay).

Cases (generated, never listed by hand): allpairspy over the five axes (every pair of
values in at least one case; its filler values are spread out, see
`matrix_cases._balanced`) plus every compressor x every precision on mirrored, loop, no
option (so each of those pairs is also seen where it is meant to train), plus the sharded
loop (`Trainer(shard=...)`, `matrix_cases.shard_cases`): every shard mode (optimizer,
gradients) x precision x strategy with a global clip, and five compositions (fp16 in the
reduce-scatter, topk with ZeRO-1, EMA; onebit_adam and Keras's accumulation refused; AdamW
with the norm excluded from weight decay by its layer's name, each mode on both two-replica
strategies), plus tensor parallelism (`matrix_cases.tensor_cases`: T = 2, the Megatron MLP of
tfpar's exported layers, on mirrored and on 2 worker processes x every precision, every
option and the name exclusion on mirrored; Keras fit, compression, sharding and one device
refused), plus Keras's own distribution API (`matrix_cases.distribution_cases`: the MLP built
under a keras.distribution `DataParallel` over 2 devices or a `ModelParallel` on a 1 x 2
mesh whose layout map splits its two hidden layers, with `tfpar.distribution.enable()`;
trained by `model.fit` and by `tfpar.Trainer` with a plain dataset: both modes, mixed
precision, accumulation, EMA, clipvalue, the weight-decay exclusion, topk and dgc, and
sharding refused; and a 2 x 1 mesh whose map lays both kernels on "batch", which the
Trainer runs as ZeRO-2 by default: both modes, fp16, accumulation, topk refused): 170 cases. The fast tier is all-pairs over {default, mirrored} x every mode and
precision x {none, topk, dgc, onebit_adam} x {none, global clip, accumulation, EMA}, plus two
sharded cases, one tensor-parallel case and one ModelParallel fit, all in this process: 20
cases; the other 145 are
`slow` (every two-process case among them, as tests/conftest.py makes every multi-process
test slow).

Every case trains 4 steps of a global batch of 16 (tests/test_compression.py's MLP: dense
gradients only, 6,660 weights) and ends in exactly one of:

- equal: it trained and matched its reference (below) within that reference's tolerance,
  and the reference holds up itself (its own reference, recursively, down to the plain
  Keras ground truth or to a pair of runs that cross-check each other; never the case
  itself, which `test_the_cases_cover_every_pair_and_never_reference_themselves` checks);
- refused: a `tfpar.TfparError` before the first step (model, `compile`, `compress_fit`,
  `Trainer(...)`, or `fit` before its first batch) whose message names one of the case's values (compressor, option,
  precision, strategy, mode or optimizer) and says what to do instead (an imperative such
  as "use"/"pass"/"leave", or a call, keyword or --config flag). The message is recorded;
- FAIL (the test fails): anything else. An exception from Keras or TensorFlow, a tfpar
  error after training began, non-finite weights, a mismatch, or a reference that fails
  (the row then names the run where the chain breaks).

The optimizer the user means (`matrix_cases.user_optimizer`): SGD(0.1, momentum 0.9);
Adam(0.01, epsilon 1e-3) for onebit_adam and dgc_adam; AdamW(0.01, weight_decay 0.5) for
the weight-decay option; options: global_clipnorm 0.1, clipnorm 0.05, clipvalue 0.005,
accumulation 2, EMA momentum 0.5 (each changes the weights by > 1e-3 here:
`test_the_options_are_active_and_accumulation_is_a_twice_larger_batch`).
`matrix_cases.build_training` passes it unchanged: dgc, onebit_adam and dgc_adam adopt it
(tfpar.compression.adopted: the momentum, Adam's betas and epsilon, a global clip move into
the compressor); ADOPTS_USERS_OPTIMIZER = False there rebuilds what a user had to write
before that (commit 5fabe9a): Keras SGD without momentum, those values given to the
compressor. Compressors:
FP16(), Int8(seed=1), TopK(0.1), PowerSGD(rank=2), Sign() with tfpar's default policy
(tensors of >= 1024 entries, biases and norms left out); dgc as DGC(ratio=1.0) (with the
SGD's momentum 0.9), onebit_adam and dgc_adam with freeze_step=100 (past the 4 steps run). These
three are configured to be lossless, so they check the plumbing (momentum, clipping, loss
scale, accumulation, EMA) exactly; their compressed phases are not in this matrix.

References and tolerances (`matrix_cases.reference_for`, `matrix_cases.compare`):

- exact: float32 with compressor none, dgc (density 1 = SGD with momentum), onebit_adam or
  dgc_adam (the Adam warm-up = Adam), on any strategy and mode: the ground truth, one
  device, plain Keras (a GradientTape loop, `apply_gradients`, then
  `finalize_variable_values` as `fit` does at its end), no compression, the same option.
  1e-5, rtol and atol, on every weight after 4 steps. Why it holds: 1 vs 2 replicas, XLA in
  the loop and Keras fit change the summation order, float32 rounding, ~1e-7 relative;
  measured 1.2e-7. Adam's epsilon is 1e-3, not Keras's 1e-7: with 1e-7 a near-zero
  gradient's step is lr * g / |g| and rounding flips it (5e-5 was measured between 1 and 2
  replicas); with 1e-3 the same noise moves a weight by lr * 1e-10 / 1e-3. It caught, at
  commit 5fabe9a: fit clipping each replica's gradient before the all-reduce (1.3e-2 with
  clipnorm), tfpar's loop never writing the EMA into the model (2.8e-2), dgc's momentum
  applied per micro-batch under accumulation (2.5e-2).
- unsharded (a `shard` case): the same case with shard='none', which must hold up itself
  (its precision or exact reference below). 1e-5 as above: each replica runs Keras's own
  update on its chunk, the sums in another order.
- precision (mixed_bfloat16, mixed_float16): the same case in float32 (on mirrored for a
  multi_worker_mirrored case: 2 replicas too, and this keeps the two-process runs down),
  which must hold up itself. Measured: |update - update_float32| / |update_float32| over
  all weights for each step's update (weights after the step minus before) and for the
  total of the 4 steps. The first update is the scale check, held tight: a scale bug is
  ~100% off there (1-bit Adam's step 32768x too small under fp16: 99.99% at 5fabe9a), a clip
  on scaled gradients or a second unscale as much. Later updates compound rounding through
  the weights they start from and are held loosely: bf16 keeps 8 significant bits (2^-9 =
  0.2% per rounding, many roundings in forward and backward), fp16 11, and Adam turns a
  rounding of a small gradient into a visible step (Adam/AdamW under fp16 measured 5.8% on
  its 4th update in the loop, and 6.0% in fit once the logits are float32: not a tfpar
  effect). Tolerances, at least twice the largest error the rows that hold up measured at
  commit af13dbd (in brackets, bf16 / fp16):
  - stateless (none, fp16, dgc, onebit_adam, dgc_adam): first update within 10% / 1%
    (3.9% / 0.14%), each later update and the total within 15% (5.5% / 5.8%);
  - rounding (int8: a rounding can cross one of its stochastic-rounding steps, moving that
    entry by a whole quantum): first within 10% / 5% (1.9% / 0.4%), later ones and the
    total within 15% (4.1% / 2.5%);
  - feedback (topk, sign, powersgd: a rounding changes which entries are sent, or their
    sign, and the error feedback carries the difference on, so the runs drift apart):
    first within 30% / 5% (8.9% / 1.7%), the total within 30% / 15% (10.8% / 3.6%); later
    updates are not compared one by one (up to 16.7% / 9.7%). bf16's first bound was 20%
    until TensorFlow 2.21 with Keras 3.15.1 and NumPy 2.4: there top-k under bf16 sends other
    entries than in float32 from the first step (mirrored/fit/topk/clipvalue: 20.9% on update 1,
    19.2% in total, the same at the commit that measured 8.9%). 30% is still a third of what
    the scale check catches (~100%).
- lossy compressors in float32 (fp16, int8, topk, powersgd, sign), which have no exact
  one-device twin, in this order of preference:
  - with accumulation: the option's exact relation, 2 micro-batches of 16 = one batch of
    32 (the same compressor, strategy and mode; it holds for plain Keras, SGD and Adam, to
    1.5e-8: `test_the_options_are_active_and_accumulation_is_a_twice_larger_batch`);
  - on one device: plain Keras with the compressor's Compression called where the
    all-reduce would be (one replica: what it sends is what comes back), then
    `apply_gradients`, so clipping, EMA and weight decay act after the compressor, as
    tfpar's loop does after its aggregator;
  - with EMA on 2 replicas: EMA's relation: every step equals the same case without EMA,
    and the final weights are Keras's moving average of those steps (the first step's
    weights, then 0.5 * average + 0.5 * weights);
  - on 2 replicas, fit against tfpar's loop and the other way round (where one refuses
    the option there is no reference and the row fails: the other trains what it refuses);
    the loop on 2 worker processes against the loop on mirrored (the same compressor math
    through other collectives).
  1e-5 as above: the same arithmetic in another order (measured up to 2.9e-6, where the
  fp16 compressor rounds a value that the order moved across a float16 rounding boundary:
  one float16 ulp of a gradient, times the learning rate). The fp16 compressor rounds each
  sum it sends, so against a reference that rounds other sums (2 micro-batches against one
  2x batch) its atol is 2^-10 of how far the reference moved: each sum's rounding is at most
  2^-11 of the entry (measured 1.12e-5 of 4.26e-2 moved, 2.6e-4; `ROUNDING` in
  tests/matrix_cases.py). Where fit and the loop, or mirrored
  and the workers, disagree, the row names both: neither side is the truth.

Speed: the in-process cases share this process (one default and one mirrored strategy for
the module, created on first use); every multi_worker_mirrored run (the cases and the
references they need) is one `procs.launch(2, "matrix_worker.py", ...)`, started in a thread
when the module starts and read when a case needs it. Each run builds its model, traces
and trains in 0.2-6 s (a plain-Keras reference 0.2 s). Measured on the 2 shared cores
beside other jobs: the fast tier 1.5 min (40 s of CPU; load average 4-5), both tiers 10 to
14 min at load 5-7 (about 5 min of CPU; the two workers' 25 runs take 2-3 min beside the
in-process ones) and 5 min at load 2-3; the generated section of docs/matrix.md gives the
last run's times.

Output: with TFPAR_WRITE_MATRIX=1 the module, at its end, rewrites the generated section of
docs/matrix.md (between `<!-- matrix:begin -->` and `<!-- matrix:end -->` under "##
Combination matrix (generated)") from the cases this run produced (one row each, nothing
else) and writes every case's verdict and every run's raw result to
benchmarks/results/matrix.json. Without it nothing is written. Regenerate both tiers with
`TFPAR_WRITE_MATRIX=1 python -m pytest -n 0 tests/test_matrix.py`; TFPAR_MATRIX_CODE, if
set, says which code ran (default: `git describe --always --dirty`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import matrix_cases as M
from procs import REPO, launch

CASES, FAST = M.all_cases()
ROWS: dict[M.Run, M.Verdict] = {}
DOC = REPO / "docs" / "matrix.md"
RAW = REPO / "benchmarks" / "results" / "matrix.json"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
WORKER_TIMEOUT = 1200

pytestmark = pytest.mark.xdist_group("matrix")  # one TensorFlow process for every case


class Matrix:
    """The runs of this module: in-process ones trained on demand (once each), the two
    workers' read from their one launch."""

    def __init__(self, selected: list[M.Run], workdir: Path):
        self.weights = {kind: M.initial_weights(kind) for kind in (False, True)}  # by model: tensor or not
        self.results: dict[str, M.Result] = {}
        self.seconds: dict[str, float] = {"in_process": 0.0}
        self._strategies: dict[str, object] = {}
        self._workdir = workdir
        self._worker_keys = [run.key for run in M.needed(selected) if not run.in_process]
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._workers = self._pool.submit(self._launch) if self._worker_keys else None

    def strategy(self, name: str):
        if name not in self._strategies:
            import tfpar

            self._strategies[name] = (tfpar.create_strategy("mirrored", devices=["/cpu:0", "/cpu:1"])
                                      if name == "mirrored" else tfpar.create_strategy("default"))
        return self._strategies[name]

    def _launch(self) -> dict[str, M.Result]:
        (self._workdir / "runs.json").write_text(json.dumps(self._worker_keys))
        start = time.perf_counter()
        try:
            done = launch(2, "matrix_worker.py", str(self._workdir / "runs.json"), str(self._workdir),
                          timeout=WORKER_TIMEOUT)
            output, code = done.stdout + done.stderr, done.returncode
        except Exception as e:  # pylint: disable=broad-except  (a timeout: the runs not reported fail)
            partial = getattr(e, "stdout", None) or b""  # what the workers printed before it
            partial = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            output, code = f"{partial}\n{type(e).__name__}: {e}", None
        self.seconds["workers"] = time.perf_counter() - start
        return self._read_workers(output, code)

    def _read_workers(self, output: str, code) -> dict[str, M.Result]:
        records: dict[tuple[int, int], dict] = {}
        for line in output.splitlines():
            found = re.search(r"MATRIX (\{.*\})\s*$", line)
            if found:
                record = json.loads(found.group(1))
                records[(record["index"], record["worker"])] = record
        results = {}
        for index, key in enumerate(self._worker_keys):
            mine, other = records.get((index, 0)), records.get((index, 1))
            if mine is None or other is None:
                results[key] = M.Result(key, "crashed", error="WorkerDied", summary=(
                    f"no result from worker {0 if mine is None else 1} (launch exit code {code})"),
                    message=f"output tail: {output[-3000:]}")
                continue
            result = M.Result(key, mine["outcome"], mine["message"], mine["error"], mine["summary"], mine["seconds"])
            if mine["outcome"] != other["outcome"]:
                result.outcome, result.error = "crashed", "WorkersDisagree"
                result.summary = f"the workers disagree: worker 0 {mine['outcome']}, worker 1 {other['outcome']}"
                result.message = f"worker 0: {mine['outcome']} {mine['message']}; worker 1: {other['outcome']} {other['message']}"
            elif mine["outcome"] == "trained":
                saved = np.load(self._workdir / mine["weights"])
                result.initial, result.final, result.steps = saved["initial"], saved["final"], list(saved["steps"])
                if mine["digest"] != other["digest"]:
                    result.outcome, result.error = "crashed", "ReplicasDiverged"
                    result.summary = result.message = "the two workers ended with different weights"
            results[key] = result
        return results

    def result(self, run: M.Run) -> M.Result:
        if run.key not in self.results:
            if run.in_process:
                result = M.execute(run, None if run.strategy == "plain" else self.strategy(run.strategy),
                                   self.weights[run.tensor > 0])
                self.seconds["in_process"] += result.seconds
                self.results[run.key] = result
            else:
                if self._workers is None:
                    raise AssertionError(f"{run.key} was not planned for the workers")
                self.results.update(self._workers.result())
                if run.key not in self.results:
                    raise AssertionError(f"{run.key} was not planned for the workers")
        return self.results[run.key]

    def judge(self, case: M.Run) -> M.Verdict:
        self._gather(case, set())
        return M.verdict(case, self.results)

    def _gather(self, run: M.Run, seen: set) -> None:
        """Trains `run` and, where it trained, the references its verdict reads."""
        if run in seen:
            return
        seen.add(run)
        reference = M.reference_for(run)
        if self.result(run).outcome == "trained" and reference is not None:
            self._gather(reference.run, seen)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    selected = [case for item in request.session.items
                if item.module is request.module and (case := _callspec_case(item)) is not None]
    start = time.perf_counter()
    runs = Matrix(selected, tmp_path_factory.mktemp("matrix"))
    yield runs
    runs.close()
    runs.seconds["module"] = time.perf_counter() - start
    if os.environ.get("TFPAR_WRITE_MATRIX") == "1" and ROWS:
        write_outputs(runs)


def _callspec_case(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("case") if callspec is not None else None


# -- the cases ----------------------------------------------------------------------------

@pytest.mark.timeout(WORKER_TIMEOUT + 300)  # the first two-process case waits for the workers
@pytest.mark.parametrize("case", [pytest.param(case, id=case.key, marks=() if case in FAST else pytest.mark.slow)
                                  for case in CASES])
def test_combination(case, matrix):
    verdict = matrix.judge(case)
    ROWS[case] = verdict
    assert verdict.passed, f"{case.key}: {verdict.detail}"


# -- the harness itself ----------------------------------------------------------------------

def test_the_cases_cover_every_pair_and_never_reference_themselves():
    axes = [M.STRATEGIES, M.MODES, M.PRECISIONS, M.COMPRESSORS, M.OPTIONS]
    full = set(M.full_cases())
    as_rows = [(c.strategy, c.mode, c.precision, c.compressor, c.option) for c in full]
    for i, j in itertools.combinations(range(len(axes)), 2):
        seen = {(row[i], row[j]) for row in as_rows}
        assert seen == set(itertools.product(axes[i], axes[j])), (i, j)
    fast_rows = [(c.strategy, c.mode, c.precision, c.compressor, c.option) for c in FAST]
    fast_axes = [M.FAST_STRATEGIES, M.MODES, M.PRECISIONS, M.FAST_COMPRESSORS, M.FAST_OPTIONS]
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(r[i], r[j]) for r in fast_rows} == set(itertools.product(fast_axes[i], fast_axes[j]))
    assert {(c.compressor, c.precision) for c in full if (c.strategy, c.mode, c.option) ==
            ("mirrored", "loop", "none")} == set(itertools.product(M.COMPRESSORS, M.PRECISIONS))
    for run in M.needed(CASES):
        reference = M.reference_for(run)
        assert reference is None or reference.run != run, run.key
        assert M.Run.from_key(run.key) == run


def test_the_options_are_active_and_accumulation_is_a_twice_larger_batch(matrix):
    """The ground truth itself: each option changes the weights far beyond 1e-5 (so a case
    that ignored it would fail), and Keras's accumulation of 2 micro-batches is one 2x batch
    (the relation the lossy accumulation cases are held to), for SGD and Adam."""
    for family in ("sgd", "adam"):
        base = matrix.result(M.Run("plain", "tape", "float32", "none", "none", family)).final
        for option in M.OPTIONS[1:]:
            run = M.Run("plain", "tape", "float32", "none", option,
                        "adamw" if option == "weight_decay" else family)
            result = matrix.result(run)
            assert result.outcome == "trained", result.message
            assert np.abs(result.final - base).max() > 100 * M.EXACT_TOL, run.key
        accumulated = matrix.result(M.Run("plain", "tape", "float32", "none", "accumulation", family)).final
        big = matrix.result(M.Run("plain", "tape", "float32", "none", "none", family, 2 * M.BATCH, M.STEPS // 2)).final
        np.testing.assert_allclose(accumulated, big, rtol=M.EXACT_TOL, atol=M.EXACT_TOL)
    decayed = matrix.result(M.Run("plain", "tape", "float32", "none", "weight_decay", "adamw")).final
    excluded = matrix.result(M.Run("plain", "tape", "float32", "none", "decay_excluded", "adamw")).final
    assert np.abs(excluded - decayed).max() > 100 * M.EXACT_TOL  # Keras excludes the norm by its name


# -- output ----------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: dict[M.Run, M.Verdict]) -> str:
    lines = ["| strategy | mode | precision | compressor | option | outcome | reference, tolerance / refusal | numbers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in [c for c in CASES if c in rows]:
        v = rows[case]
        where = v.reference if v.outcome == "refused" else f"{v.reference}; {v.tolerance}".strip("; ")
        outcome = "**FAIL**" if v.outcome == "FAIL" else v.outcome
        lines.append("| " + " | ".join(_cell(x) for x in (
            case.strategy, case.mode, case.precision, case.compressor,
            ", ".join([case.option, *([f"shard={case.shard}"] if case.shard != "none" else []),
                       *([f"tensor={case.tensor}"] if case.tensor else []),
                       *([f"keras.distribution: {case.distribution}"] if case.distribution else [])]), outcome, where,
            v.detail)) + " |")
    return "\n".join(lines)


def code_version() -> str:
    """Which code produced the table: TFPAR_MATRIX_CODE, else `git describe` of the checkout."""
    if os.environ.get("TFPAR_MATRIX_CODE"):
        return os.environ["TFPAR_MATRIX_CODE"]
    import subprocess

    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return f"commit {done.stdout.strip()}" if done.returncode == 0 else "a checkout without git"


def roots(rows: dict[M.Run, M.Verdict]) -> str:
    """The runs where the failing rows break, with how many rows break there."""
    found: dict[str, list] = {}
    for case in [c for c in CASES if c in rows and rows[c].outcome == "FAIL"]:
        found.setdefault(rows[case].root, [rows[case].cause, 0])[1] += 1
    return "\n".join(f"- `{root}` ({n} row{'s' if n > 1 else ''}): {_cell(cause)[:400]}"
                     for root, (cause, n) in found.items())


def write_outputs(runs: Matrix) -> None:
    counts = {k: sum(v.outcome == k for v in ROWS.values()) for k in ("equal", "refused", "FAIL")}
    tier = "both tiers" if set(CASES) <= set(ROWS) else (
        "the fast tier" if set(ROWS) <= FAST else f"{len(ROWS)} selected cases")
    seconds = runs.seconds
    timing = (f"in-process runs {seconds['in_process']:.0f} s"
              + (f", the two workers {seconds['workers']:.0f} s beside them" if "workers" in seconds else "")
              + f", the module {seconds['module']:.0f} s")
    failing = roots(ROWS)
    section = "\n".join([
        BEGIN,
        f"Written by `TFPAR_WRITE_MATRIX=1 python -m pytest -n 0 tests/test_matrix.py` on "
        f"{datetime.date.today().isoformat()} ({tier}, {code_version()}): {len(ROWS)} cases, "
        f"{counts['equal']} equal, {counts['refused']} refused, {counts['FAIL']} FAIL. Wall time on "
        f"the 2 shared cores: {timing}. What each reference and tolerance means: the docstring of "
        "`tests/test_matrix.py`; raw results: `benchmarks/results/matrix.json`.",
        "",
        table(ROWS),
        *(["", "Where the failing rows break (a row fails with the run its reference chain breaks at):", "",
           failing] if failing else []),
        END])
    text = DOC.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## Combination matrix (generated)\n\n" + section + "\n"
    DOC.write_text(text)
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "tier": tier, "code": code_version(),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "cases": [dataclasses_dict(case) | {"outcome": v.outcome, "reference": v.reference,
                                            "tolerance": v.tolerance, "detail": v.detail,
                                            "fails_at": v.root, "cause": v.cause,
                                            "seconds": round(runs.results[case.key].seconds, 2),
                                            "message": runs.results[case.key].message}
                  for case, v in sorted(ROWS.items(), key=lambda kv: CASES.index(kv[0]))],
        "runs": [r.to_json() for r in runs.results.values()],
    }, indent=1) + "\n")


def dataclasses_dict(case: M.Run) -> dict:
    return {"key": case.key, "strategy": case.strategy, "mode": case.mode, "precision": case.precision,
            "compressor": case.compressor, "option": case.option, "optimizer": case.family, "shard": case.shard,
            "tensor": case.tensor, "distribution": case.distribution}
