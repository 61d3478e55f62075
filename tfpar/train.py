"""The training binary: a config in, a trained model, eval and a sample out.

    python -m tfpar.train --config=configs/gpt_tiny.py --workdir=/tmp/run
    python -m tfpar.train --config=configs/gpt_tiny.py --config.strategy=mirrored \
        --config.strategy_args.virtual_devices=2 --config.train.steps=2000 --workdir=/tmp/run
    tfpar-launch --workers 2 -- tfpar-train --config=configs/gpt_tiny.py --workdir=/tmp/run

Writes to the workdir: TensorBoard summaries (tensorboard/), checkpoints (checkpoints/,
by the chief only), results.json (final eval) and sample.txt (a generated text sample).
Run it again with the same workdir and it resumes from the newest checkpoint, at the
same step and data position. SIGTERM to any worker: every worker saves at the same step
and exits with code 75 (tfpar.preemption); `tfpar-launch --max-restarts K` restarts the
group, which resumes there. NaN/Inf gradients stop the run naming the step
(config.train.nonfinite), before they could be checkpointed.
"""

from __future__ import annotations

import os
import sys
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

from tfpar.config import ConfigError, validate
from tfpar.errors import TfparError
from tfpar.run import fit_jit_compile, train_and_evaluate  # noqa: F401  (the binary's public API)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, summaries and results.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show TensorFlow's C++ start-up lines (oneDNN, CUDA "
                             "probes) and tfpar's info logs.")


def check_workdir(workdir: str) -> None:
    """Creates `workdir` and proves it is writable, before anything expensive."""
    if os.path.isfile(workdir):
        raise ConfigError(f"--workdir={workdir} is a file, not a directory. Pass a directory "
                          "(it is created if missing), e.g. --workdir=/tmp/tfpar_run.")
    try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ConfigError(
            f"--workdir={workdir} is not writable ({e.strerror}). Pick a directory you can write "
            "to, or fix its permissions / free space."
        ) from None


def import_tensorflow_quietly() -> None:
    """Loads TensorFlow without its C++ start-up lines (the oneDNN notice, CUDA probes such
    as "failed call to cuInit" on a CPU-only machine), which it writes to stderr before
    any log level applies. Lines of a failed import are shown."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # later C++ logs (cuInit) as well
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            import tensorflow  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _refuse(message: str, code: int = 2) -> None:
    """The one line a refusal gets (no absl error line beside it), then exit."""
    print(f"tfpar-train: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _load_config():
    """The config file, loaded; a file that does not load is one line naming it."""
    try:
        config = _CONFIG.value
        config.mode  # noqa: B018  (a config file that failed to load raises here)
    except OSError as e:
        _refuse(f"--config could not be loaded ({str(e).splitlines()[0]}). Check the path, e.g. "
                "--config=configs/gpt_tiny.py.")
    return config


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if not _VERBOSE.value:
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # our own progress lines say what matters
        import_tensorflow_quietly()
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config=configs/gpt_tiny.py")
    config = _load_config()
    workdir = _WORKDIR.value
    if not workdir:
        raise app.UsageError("--workdir is required, e.g. --workdir=/tmp/tfpar_run")
    try:
        from tfpar.strategy.keras_backend import check_keras_backend

        check_keras_backend()  # before validate imports Keras (KERAS_BACKEND=jax: one line)
        validate(config)
        check_workdir(workdir)
        train_and_evaluate(config, workdir)
    except TfparError as e:
        _refuse(str(e))
    except Exception as e:  # noqa: BLE001  (only a lost peer is turned into a message)
        lost = _lost_peer(e)
        if lost is None:
            raise
        from tfpar.strategy.lost_peer import describe_lost_peer

        who = describe_lost_peer(str(e))
        _refuse(f"a peer of this worker{f' ({who})' if who else ''} stopped answering ({lost}). "
                "This worker stops too. "
                "Restart the whole group (tfpar-launch --max-restarts K does it for you): the run "
                "resumes from its newest checkpoint in --workdir.", code=1)


def _lost_peer(error: Exception) -> str | None:
    """The one telling line of a collective that failed because a peer died, else None."""
    import tensorflow as tf

    if not isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                              tf.errors.AbortedError)):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if "aborted by" in line or "deadline" in line.lower()]
    return (telling or lines or [type(error).__name__])[0][:300]


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config-override mistakes turned into one clear line."""
    try:
        return flags.FLAGS(argv)
    except SyntaxError as e:  # the config file itself, executed while --config is parsed
        print(f"tfpar-train: --config file {e.filename}, line {e.lineno}: {e.msg}. Fix that line.",
              file=sys.stderr)
    except flags.Error as e:
        print(f"tfpar-train: {e}\nPass --helpfull for every flag.", file=sys.stderr)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        detail = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
        overrides = [a for a in argv[1:] if a.startswith("--config.")]
        print(f"tfpar-train: bad config override among {' '.join(overrides) or argv[1:]}: "
              f"{detail}. Config keys are fixed by the config file; see configs/ or "
              "tfpar/config.py for the keys.", file=sys.stderr)
    sys.exit(2)


def run() -> None:
    """Console entry point (`tfpar-train`)."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
