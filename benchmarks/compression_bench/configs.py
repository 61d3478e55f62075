"""The configurations: each name is a compressor with its arguments, as the binary takes them.

A configuration is `--config.compression=KIND` with `--config.compression_args.*` (ARGS,
plus `embeddings=True` where EMBED) on the model's config file, and the optimizer that
config file names (gpt_tiny and gpt_wide: AdamW, 60 warm-up steps, cosine decay, weight
decay 0.01, beta_2 0.98, clip_norm 1.0). onebit_adam and dgc_adam take that AdamW as the
binary gives it to them (its betas, epsilon and clip_norm move into the compressor; a
plain SGD with its schedule and weight decay applies their step). dgc and none(sgd) train
with the SGD that OPTIMIZER_FOR names, `--config.optimizer.name=sgd
--config.optimizer.learning_rate=0.1` (momentum 0.9, so nesterov; the config's clip_norm
and weight decay). Every configuration is validated as the binary validates its flags
(tfpar.config.validate) before anything trains.

Example:
    >>> flags("onebit_adam+all+every2")
    ['--config.mode=loop', '--config.compression=onebit_adam', '--config.compression_args.freeze_step=60', ...]
"""

from __future__ import annotations

import copy
import math
import os
from typing import NamedTuple

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)


class Entry(NamedTuple):
    kind: str          # --config.compression
    args: dict         # --config.compression_args.*
    embeddings: bool   # also compress the embeddings


ONEBIT = {"freeze_step": 60}                    # onebit_adam's arguments in every run
EVERY_TENSOR = {"min_size": 0, "skip": "none"}  # the policy skips nothing
DGC_RAMP = {"sparsity_warmup_steps": 60}        # dgc's density warm-up in every run


def _dgc(ratio: float, **args) -> Entry:
    return Entry("dgc", {"ratio": ratio, **DGC_RAMP, **args}, True)


def _psgd(schedule: str, start: int, embeddings: bool = True, **args) -> Entry:
    return Entry("powersgd", {"rank_schedule": schedule, "warmup_steps": start, **args}, embeddings)


def _bf16(schedule: str, start: int, embeddings: bool = True) -> Entry:
    return _psgd(schedule, start, embeddings, factor_dtype="bfloat16")


def _dgc_adam(ratio: float, freeze: int, momentum: float) -> Entry:
    return Entry("dgc_adam", {**EVERY_TENSOR, "ratio": ratio, "freeze_step": freeze, "momentum": momentum}, True)


CONFIGS: dict[str, Entry] = {
    "none": Entry("none", {}, False),
    "fp16": Entry("fp16", {}, False),
    "bf16": Entry("bf16", {}, False),
    "int8": Entry("int8", {}, False),
    "topk(0.01)": Entry("topk", {"ratio": 0.01}, False),
    "topk(0.01)+emb": Entry("topk", {"ratio": 0.01}, True),
    "powersgd(4)": Entry("powersgd", {"rank": 4}, False),
    "powersgd(4)+emb": Entry("powersgd", {"rank": 4}, True),
    "sign": Entry("sign", {}, False),
    # compressors that keep the model (the binary's arguments)
    "dgc(0.01)": _dgc(0.01),
    "dgc(0.001)": _dgc(0.001),
    # a longer density warm-up (a third and a half of 600 steps)
    "dgc(0.01)+warm200": _dgc(0.01, sparsity_warmup_steps=200),
    "dgc(0.01)+warm300": _dgc(0.01, sparsity_warmup_steps=300),
    "powersgd(4)+start": _psgd("8@0,4@100", 60),
    # a longer start, and higher ranks for longer before rank 4
    "powersgd(4)+start120": _psgd("8@0,4@100", 120),
    "powersgd(4)+start+8to300": _psgd("8@0,4@300", 60),
    "powersgd(4)+start+16-8-4": _psgd("16@0,8@150,4@350", 60),
    "powersgd(4)+start120+16-8-4": _psgd("16@0,8@150,4@350", 120),
    "powersgd(4)+start120+16-8-4@250": _psgd("16@0,8@100,4@250", 120),
    # its start sent in fp16 (every tensor): half the start's bytes
    "powersgd(4)+fp16start120+16-8-4": _psgd("16@0,8@150,4@350", 120, warmup_compression="fp16"),
    # gpt_tiny over 2000 steps: a 10% start, ranks 16 and 8, then rank 3 (or 4), bfloat16 factors
    **{f"powersgd({r})+bf16+start200+16-8-{r}": _bf16(f"16@0,8@300,{r}@700", 200) for r in (3, 4)},
    # gpt_tiny's frontier: the same start and schedule ending at rank 6 and 8
    "powersgd(6)+bf16+start120+16-8-6": _bf16("16@0,8@150,6@350", 120),
    "powersgd(8)+bf16+start120+16-8": _bf16("16@0,8@150", 120),
    # ... without the embeddings (sent float32)
    **{f"powersgd({r})+bf16+start120+16-8-{r}-emb": _bf16(f"16@0,8@150,{r}@350", 120, False) for r in (4, 8)},
    # ... one rank from the start's end on
    **{f"powersgd({r})+bf16+start120": Entry("powersgd", {"rank": r, "warmup_steps": 120,
                                                          "factor_dtype": "bfloat16"}, True) for r in (16, 32)},
    "powersgd(4)+bf16+start120+16-8-4": _bf16("16@0,8@150,4@350", 120),
    # DGC with an uncompressed start (momentum SGD at density 1), then the ramp
    "dgc(0.01)+start120": _dgc(0.01, warmup_steps=120),
    "dgc(0.008)+start120": _dgc(0.008, warmup_steps=120),
    "dgc(0.008)": _dgc(0.008),
    "dgc(0.008)-masking": _dgc(0.008, masking=False),
    "onebit_adam": Entry("onebit_adam", {**ONEBIT}, False),
    "onebit_adam+fp16start": Entry("onebit_adam", {**ONEBIT, "warmup_compression": "fp16"}, False),
    # the 1-bit momentum sent every 2nd / 4th compressed step, embeddings too
    "onebit_adam+emb+every2": Entry("onebit_adam", {**ONEBIT, "exchange_every": 2}, True),
    "onebit_adam+emb+every4": Entry("onebit_adam", {**ONEBIT, "exchange_every": 4}, True),
    # every tensor 1-bit (biases and norms too, as DeepSpeed's), every step / every 2nd step
    "onebit_adam+all": Entry("onebit_adam", {**ONEBIT, **EVERY_TENSOR}, True),
    **{f"onebit_adam+all+every2{f'+freeze{f}' if f != 60 else ''}":
       Entry("onebit_adam", {**ONEBIT, **EVERY_TENSOR, "exchange_every": 2, "freeze_step": f}, True)
       for f in (60, 90, 120)},
    # DGC's top-k on Adam's frozen variance, every tensor, 50x: without a local velocity
    # (momentum 0, the default) and with DGC's momentum correction and masking
    **{f"dgc_adam({ratio:g})+all+freeze{freeze}+momentum{momentum:g}": _dgc_adam(ratio, freeze, momentum)
       for ratio, freeze, momentum in [(0.01, 60, 0.0), (0.01, 120, 0.0), (0.01, 200, 0.0), (0.01, 120, 0.5),
                                       (0.01, 60, 0.9), (0.01, 120, 0.9), (0.01, 200, 0.9), (0.0125, 120, 0.9),
                                       (0.025, 120, 0.9), (0.025, 200, 0.9)]},
    # DGC's optimizer without compression (DGC at density 1): what DGC is measured against
    "none(sgd)": Entry("none", {}, False),
    # measures the link and the compute at build, then becomes one of its candidates
    "auto": Entry("auto", {}, False),
    # auto told that the goal is none's loss at 600 steps: room for candidates that need more
    # steps (DiLoCo's 13/12), with --compressed-steps above 600
    "auto+quality(600)": Entry("auto", {"auto_quality_steps": 600}, False),
}

#: DiLoCo's configurations (`--config.parallel.sync=diloco`): H local steps of the config's
#: AdamW, then the outer SGD on the mean delta. (H, outer learning rate, outer momentum,
#: outer code): the paper's Nesterov 0.7 / 0.9, and plain averaging (1.0, none: local SGD);
#: `+int8` / `+int4` / `+fp16`: the outer gradients in that code, with error feedback;
#: `+overlap(tau)`: each round's exchange beside the next tau steps; `+streaming(F)`: the
#: model in F fragments, each exchanged on steps of its own (Streaming DiLoCo);
#: `+outer(LR)+momentum(M)`: the outer Nesterov SGD at that learning rate and momentum
DILOCO = {**{f"diloco({h})": (h, 0.7, 0.9, "none", 0, 1) for h in (10, 25, 50)},
          **{f"diloco({h})+avg": (h, 1.0, 0.0, "none", 0, 1) for h in (5, 10, 25)},
          **{f"diloco({h})+avg+{code}": (h, 1.0, 0.0, code, 0, 1) for h in (5, 10, 25)
             for code in ("fp16", "int8", "int4")},
          **{f"diloco({h})+avg+int4+overlap({tau})": (h, 1.0, 0.0, "int4", tau, 1) for h in (5, 10) for tau in (1, 2)},
          **{f"diloco({h})+avg+int4+streaming({f})": (h, 1.0, 0.0, "int4", 0, f) for h in (10, 20) for f in (2, 5)},
          **{f"diloco({h})+avg+int4+overlap({tau})+streaming({f})": (h, 1.0, 0.0, "int4", tau, f)
             for h in (10, 20) for tau in (1, 2) for f in (2, 5)},
          # the outer Nesterov SGD between the paper's (0.7, 0.9) and plain averaging, for
          # short runs: its steady-state step is learning_rate / (1 - momentum) deltas
          **{f"diloco({h})+outer({rate:g})+momentum({momentum:g})+int4": (h, rate, momentum, "int4", 0, 1)
             for h in (10, 20) for rate, momentum in [(0.5, 0.5), (0.7, 0.5), (1.0, 0.3), (1.2, 0.0), (1.4, 0.0),
                                                     (0.3, 0.8), (0.2, 0.8)]}}
CONFIGS.update({name: Entry("none", {}, False) for name in DILOCO})

# --config.optimizer.* where a configuration trains with another optimizer than the config
# file's AdamW: momentum SGD at 0.1 (momentum 0.9 -> nesterov, clip_norm and weight decay
# from the config), by configuration name or by compressor
SGD = {"name": "sgd", "learning_rate": 0.1}
OPTIMIZER_FOR = {"dgc": SGD, "none(sgd)": SGD}
EMBED = r"embed"


def diloco_settings(name: str) -> dict:
    """config.parallel's DiLoCo keys for `name` ({} when it is not DiLoCo's)."""
    if name not in DILOCO:
        return {}
    steps, rate, momentum, code, overlap, fragments = DILOCO[name]
    return {"sync": "diloco", "inner_steps": steps, "outer_learning_rate": rate, "outer_momentum": momentum,
            "outer_compression": code, "overlap_steps": overlap, "fragments": fragments}


def _entry(name: str) -> Entry:
    if name not in CONFIGS:
        raise KeyError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return CONFIGS[name]


def optimizer_overrides(name: str) -> dict:
    """The --config.optimizer.* values `name` changes (none: the config file's AdamW)."""
    return dict(OPTIMIZER_FOR.get(name, OPTIMIZER_FOR.get(_entry(name).kind, {})))


def flags(name: str) -> list[str]:
    """The binary's flags for `name` (beside --config=configs/MODEL.py)."""
    kind, args, embeddings = _entry(name)
    compression_args = {**args, **({"embeddings": True} if embeddings else {})}
    sync = [f"--config.parallel.{k}={v}" for k, v in diloco_settings(name).items()]
    return (["--config.mode=loop", f"--config.compression={kind}"]
            + [f"--config.compression_args.{k}={v}" for k, v in compression_args.items()]
            + [f"--config.optimizer.{k}={v}" for k, v in optimizer_overrides(name).items()] + sync)


def run_config(config, name: str):
    """`config` (a model's config file) with `name`'s flags applied, validated as the binary does."""
    from tfpar.config import validate

    kind, args, embeddings = _entry(name)
    out = copy.deepcopy(config)
    with out.unlocked():
        out.mode, out.compression = "loop", kind
        out.compression_args.update({**args, **({"embeddings": True} if embeddings else {})})
        out.optimizer.update(optimizer_overrides(name))
        out.parallel.update(diloco_settings(name))
    validate(out)
    return out


def optimizer_config(config, name: str):
    """config.optimizer as the binary would train `name` with it."""
    return run_config(config, name).optimizer


def compression_for(name: str, steps: int = 600, tokens: int = 1024):
    """The Compression for `name` (None for DiLoCo's). `steps`: the run's length (auto's
    and the schedules' horizon); `tokens`: one replica's tokens per step (auto's compute proxy)."""
    from tfpar import compression as C

    kind, kwargs, embed = _entry(name)
    if name in DILOCO:
        return None
    if kind == "auto":
        return C.Auto(total_steps=steps, tokens=tokens, quality_steps=kwargs.get("auto_quality_steps"))
    if kind in ("dgc", "onebit_adam", "dgc_adam") or "warmup_steps" in kwargs or "rank_schedule" in kwargs:
        return C.from_config(kind, embeddings=embed, **kwargs)
    compressor = C.get(kind, **kwargs)
    return C.Compression(compressor, C.Policy(overrides={EMBED: compressor} if embed else {}))


def steps_for(name: str, args) -> int:
    """The run's length for `name`: --steps, or --compressed-steps for every compressor (a
    compressed step is cheaper, so time to quality may let it run longer; its learning-rate
    schedule spans its own length, as a user's would)."""
    return args.steps if name == "none" or not args.compressed_steps else args.compressed_steps


def analytic_bytes(variables, compressor, policy) -> int:
    """Bytes per replica per step by the compressors' own sizes (pure Python, no TF ops)."""
    from tfpar.compression.compressed_aggregator import SIZE_EXCHANGE_BYTES
    from tfpar.compression.compressors import GatherCompressor

    total, gathers = 0, False
    for v in variables:
        shape = tuple(v.shape)
        chosen = policy.choose(v.path, shape, compressor)
        size = math.prod(shape)
        total += chosen.payload_bytes(size, shape) if chosen else 4 * size
        gathers |= isinstance(chosen, GatherCompressor)
    return total + (SIZE_EXCHANGE_BYTES if gathers else 0)


def plans(variables) -> dict:
    """Per configuration: which variables each compressor takes (the rest go float32), and
    the analytic bytes of five compressors with nothing left out."""
    from tfpar import compression as C

    out = {}
    for name, entry in CONFIGS.items():
        if entry.kind == "auto" or name in DILOCO:
            continue  # decided at build, from the link: see each run's auto_decision
        compression = compression_for(name)
        out[name] = {v.path: repr(c) if c else "float32" for v, c in zip(
            variables, [compression.policy.choose(v.path, tuple(v.shape), compression.compressor)
                        for v in variables])}
    everything = C.Policy(min_size=0, skip=())
    out_all = {}
    for kind, kwargs in [("fp16", {}), ("int8", {}), ("topk", {"ratio": 0.01}),
                         ("powersgd", {"rank": 4}), ("sign", {})]:
        compressor = C.get(kind, **kwargs)
        out_all[repr(compressor)] = analytic_bytes(variables, compressor, everything)
    return {"plans": out, "analytic_everything_compressed": out_all}
