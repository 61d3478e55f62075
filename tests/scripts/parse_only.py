"""Checks that one documented command's arguments parse, without running it.

argv: the command's words, e.g. `tfpar-train --config=configs/gpt_tiny.py --config.mode=loop`.
- tfpar-train / python -m tfpar.train: absl parses the flags (the config file is loaded and
  every --config.KEY override applied) and tfpar.config.validate checks the result;
- tfpar-launch: its own parser, then the command after `--`, checked the same way;
- tfpar-check, python -m tfpar.check and python benchmarks/NAME.py: the script runs until
  its argparse parser has parsed the arguments, and stops there.
Prints "PARSED <what>" and exits 0, or prints why and exits 1.
"""

import argparse
import os
import runpy
import sys

TRAIN = (["tfpar-train"], ["python", "-m", "tfpar.train"], ["python3", "-m", "tfpar.train"])


class _Parsed(Exception):
    pass


def check_train(args: list[str]) -> str:
    from absl import flags

    from tfpar import train  # defines --config, --workdir, --verbose
    from tfpar.config import validate

    flags.FLAGS(["tfpar-train", *args])
    config = train._CONFIG.value  # pylint: disable=protected-access
    validate(config)
    return f"tfpar-train ({config.model}, {config.strategy}, {config.mode}, compression {config.compression})"


def check_launch(args: list[str]) -> str:
    from tfpar import launch

    parsed = launch._parse(args)  # pylint: disable=protected-access
    return "tfpar-launch, then " + check(parsed.command)


def check_argparse_script(run, words: list[str]) -> str:
    """Runs `run()` (a script with sys.argv = words) until its argparse parser is done."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed()

    argparse.ArgumentParser.parse_args = parse_args
    sys.argv = list(words)
    try:
        run()
    except _Parsed:
        return " ".join(words[:2])
    raise AssertionError(f"{' '.join(words[:2])} finished without parsing arguments with argparse")


def check(words: list[str]) -> str:
    for prefix in TRAIN:
        if words[:len(prefix)] == prefix:
            return check_train(words[len(prefix):])
    if words[0] == "tfpar-launch":
        return check_launch(words[1:])
    if words[0] == "tfpar-check" or words[:3] in (["python", "-m", "tfpar.check"], ["python3", "-m", "tfpar.check"]):
        args = words[1:] if words[0] == "tfpar-check" else words[3:]
        return check_argparse_script(lambda: runpy.run_module("tfpar.check", run_name="__main__"),
                                     ["tfpar-check", *args])
    if words[0] in ("python", "python3") and words[1].endswith(".py"):
        return check_argparse_script(lambda: runpy.run_path(words[1], run_name="__main__"), words[1:])
    raise AssertionError(f"no parse-only check for: {' '.join(words)}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        print("PARSED " + check(sys.argv[1:]), flush=True)
    except SystemExit as exit_:  # argparse or absl refused the arguments
        print(f"REFUSED exit {exit_.code}", flush=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001  (the message is the test's evidence)
        print(f"REFUSED {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
