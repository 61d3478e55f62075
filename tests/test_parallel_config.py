"""config.parallel: every kind of parallelism from the training binary. Each kind trained
through the binary (in process), stopped and resumed, ends on the weights and optimizer
state of the same run through the Python API; bad combinations are refused at start with
the key and the fix."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import placement, recipes
from tfpar import data as data_lib
from tfpar.checkpoints import Checkpoints
from tfpar.config import ConfigError, base_config, validate
from tfpar.loop import Trainer
from tfpar.models.gpt import GPT
from tfpar.train import train_and_evaluate

STEPS, SEQ, BATCH = 6, 16, 8


def config_for(strategy="mirrored", **parallel):
    c = base_config()
    c.mode, c.strategy = "loop", strategy
    c.model_args.update(dim=32, depth=2, heads=4)
    c.data.seq_len = SEQ
    c.train.update(steps=STEPS, batch_size=BATCH, steps_per_loop=3, log_every=3, checkpoint_every=3,
                   eval_examples=32, eval_batch_size=16)
    # constant: the binary's schedule spans train.steps, so a run stopped early would decay
    # differently; AdamW with weight decay and a clip that bites
    c.optimizer.update(schedule="constant", clip_norm=0.5)
    c.sample.length = 0
    c.parallel.update(parallel)
    return c


def api_run(config, workdir):
    """The same training through tfpar's Python API (what docs/tensor_parallel.md and
    docs/placement.md show), saved like the binary saves."""
    p, t = config.parallel, config.train
    strategy = tfpar.create_strategy(config.strategy)
    keras.utils.set_random_seed(config.seed)
    splits = data_lib.load("corpus", seq_len=SEQ, seed=config.seed)
    args = dict(vocab_size=splits.info["vocab_size"], max_len=splits.info["max_len"], **config.model_args)
    pipe_plan = None
    if p.stages > 1:
        devices = tfpar.strategy.runtime.local_compute_devices()
        pipe_plan = placement.balanced(GPT(**args), devices[:p.stages], chunks=p.chunks,
                                       layout="v" if p.schedule == "zb-v" else "round_robin")
        if config.strategy == "mirrored":
            pipe_plan = pipe_plan.replicate(devices)
        keras.utils.set_random_seed(config.seed)
    scope = pipe_plan.scope() if pipe_plan is not None else strategy.scope()
    with scope as strategy:
        model = GPT(**args, tensor_parallel=p.tensor)
        optimizer = recipes.build_optimizer(config.optimizer, t.steps)
    pipe = None if pipe_plan is None else placement.Pipeline(
        model, pipe_plan, micro_batches=p.microbatches, schedule=p.schedule,
        remat={"none": False, "full": True, "attention": "attention"}[p.remat])
    trainer = Trainer(model, optimizer, recipes.SmoothedSparseCrossentropy(), strategy,
                      steps_per_loop=t.steps_per_loop, placement=pipe, shard=p.shard,
                      xla=None if t.xla else False)
    data = data_lib.distribute_train(strategy, splits.train, t.batch_size, tensor_parallel=p.tensor)
    if strategy.num_replicas_in_sync > 1:  # the binary counts the wire bytes on an iterator of
        iter(data)                         # its own first: each new iterator reshuffles the data
    trainer.fit(data, t.steps)
    saved = trainer.checkpoint_items()["optimizer"] if p.shard != "none" else trainer.optimizer
    Checkpoints(workdir, True, model=model, optimizer=saved).save(t.steps)


def checkpoint(workdir):
    path = tf.train.latest_checkpoint(os.path.join(workdir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    names = sorted(n for n in reader.get_variable_to_shape_map()
                   if "save_counter" not in n and not n.startswith("_CHECKPOINTABLE"))
    return path, {n: reader.get_tensor(n) for n in names}


KINDS = {  # in this process: 4 logical CPUs
    "tensor_2x2": dict(tensor=2),                                       # 2 data x 2 tensor
    "pipeline_1f1b_2x2": dict(stages=2, schedule="1f1b", microbatches=2, balance="params"),
    "pipeline_interleaved": dict(stages=2, schedule="interleaved", chunks=2, microbatches=2,
                                 balance="params", remat="attention"),
    "pipeline_zb_v": dict(stages=2, schedule="zb-v", chunks=2, microbatches=2, balance="params"),
    "shard_optimizer": dict(shard="optimizer"),
    "shard_gradients_tensor_2x2": dict(shard="gradients", tensor=2),   # ZeRO-2 over each DP group
}
STRATEGY = {"pipeline_interleaved": "default", "pipeline_zb_v": "default"}  # one pipeline


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_through_the_binary_resumes_onto_the_python_api_weights(tmp_path, kind):
    """The binary stopped at step 3 and restarted ends at step 6 with every weight and
    optimizer slot of the uninterrupted Python API run (1e-5)."""
    config = config_for(STRATEGY.get(kind, "mirrored"), **KINDS[kind])
    config.train.xla = False  # XLA's compile of each replica's step is most of the time here
    validate(config)
    api_run(config, str(tmp_path / "api"))
    short = config_for(STRATEGY.get(kind, "mirrored"), **KINDS[kind])
    short.train.update(steps=3, xla=False)
    train_and_evaluate(short, str(tmp_path / "binary"))
    train_and_evaluate(config, str(tmp_path / "binary"))
    path_a, a = checkpoint(str(tmp_path / "api"))
    path_b, b = checkpoint(str(tmp_path / "binary"))
    assert path_a.endswith("ckpt-6") and path_b.endswith("ckpt-6") and a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_tensor_parallel_binary_run_equals_the_python_api(tmp_path):
    """The fast tier's one: 2 data x 2 tensor-parallel replicas, one block, 2 steps."""
    config = config_for(tensor=2)
    config.model_args.depth = 1
    config.train.update(steps=2, steps_per_loop=2, checkpoint_every=2, eval_examples=16)
    config.sample.length = 4  # sampled from the unsplit copy
    api_run(config, str(tmp_path / "api"))
    results = train_and_evaluate(config, str(tmp_path / "binary"))
    assert results["examples"] == 16 and np.isfinite(results["loss"])
    _, a = checkpoint(str(tmp_path / "api"))
    _, b = checkpoint(str(tmp_path / "binary"))
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-5, err_msg=name)


BAD = [
    (dict(tensor=3), "loop", "config.parallel.tensor: T=3 does not divide the 4 attention heads"),
    (dict(tensor=2), "fit", "config.parallel.tensor: pipelines, tensor parallelism and sharding run in "
                            "tfpar's loop: add --config.mode=loop"),
    (dict(stages=4, schedule="interleaved", chunks=2, microbatches=4), "loop",
     "8 stage groups, but gpt of depth 2 has 6 stages"),
    (dict(stages=2, schedule="interleaved"), "loop", "config.parallel.chunks: schedule interleaved puts v >= 2"),
    (dict(stages=2, schedule="interleaved", chunks=2, microbatches=3), "loop",
     "config.parallel.microbatches: schedule interleaved runs micro-batches in rounds of 2"),
    (dict(stages=2, schedule="zb-v"), "loop", "config.parallel.chunks: schedule zb-v puts 2 stage groups"),
    (dict(stages=2, schedule="zb-h1", remat="full"), "loop", "use --config.parallel.remat=attention"),
    (dict(schedule="1f1b"), "loop", "config.parallel.schedule: applies to a pipeline; with parallel.stages=1"),
    (dict(stages=2, tensor=2), "loop", "config.parallel.tensor: a pipeline of tensor-parallel stages is not built"),
    (dict(stages=2, shard="optimizer"), "loop", "config.parallel.shard: shard='optimizer' with layer placement"),
    (dict(schedule="pipedream"), "loop", "config.parallel.schedule: 'pipedream' is not one of gpipe, 1f1b"),
    (dict(balance="memory"), "loop", "config.parallel.balance: 'memory' is not one of params, flops, seconds"),
    (dict(stages=0), "loop", "config.parallel.stages: must be a positive integer"),
]


@pytest.mark.parametrize("parallel,mode,message", BAD)
def test_bad_combinations_are_refused_with_the_fix(parallel, mode, message):
    config = config_for(**parallel)
    config.mode = mode
    with pytest.raises(ConfigError) as raised:
        validate(config)
    assert message in str(raised.value)


def test_refused_by_the_devices_at_start(tmp_path):
    """T or S larger than the devices, checked right after the strategy starts (4 CPUs)."""
    for parallel, message in ((dict(tensor=8), "config.parallel.tensor: T=8 needs groups of 8 "
                               "replicas"),
                              (dict(stages=3, microbatches=1), "config.parallel.stages: 3 stages need a "
                               "multiple of 3 devices on each worker")):
        config = config_for(**parallel)
        config.model_args.heads = 8 if "tensor" in parallel else 4
        validate(config)
        with pytest.raises(ConfigError, match=message):
            train_and_evaluate(config, str(tmp_path))
    config = config_for(tensor=2)
    config.optimizer.name = "lamb"
    with pytest.raises(ConfigError, match="LAMB scales each variable by its whole norm"):
        validate(config)


def keras_hub_config(tmp_path, tensor, steps=STEPS):
    """The binary on a keras-hub Llama preset (a directory save_to_preset wrote: the format
    of keras-hub's published presets), split T ways by Llama's own layout map."""
    import ml_collections

    preset = tmp_path / "llama_preset"
    if not preset.exists():
        keras_hub = pytest.importorskip("keras_hub")
        keras.utils.set_random_seed(0)
        keras_hub.models.LlamaBackbone(vocabulary_size=256, num_layers=1, num_query_heads=4, num_key_value_heads=2,
                                       hidden_dim=32, intermediate_dim=64,
                                       max_sequence_length=SEQ).save_to_preset(str(preset))
    config = config_for(tensor=tensor)
    config.model = "keras_hub"
    config.model_args = ml_collections.ConfigDict(dict(backbone="LlamaBackbone", preset=str(preset), args={}))
    config.train.update(steps=steps, xla=False)
    validate(config)
    return config


@pytest.mark.slow
def test_a_keras_hub_preset_trains_split_through_the_binary_and_resumes_at_its_step(tmp_path):
    """parallel.tensor=2 on a Llama preset, stopped at step 3 and resumed, ends at step 6 on
    the weights and optimizer state of the unsplit run (T = 1) of the same preset."""
    train_and_evaluate(keras_hub_config(tmp_path, 1), str(tmp_path / "unsplit"))
    train_and_evaluate(keras_hub_config(tmp_path, 2, steps=3), str(tmp_path / "split"))
    train_and_evaluate(keras_hub_config(tmp_path, 2), str(tmp_path / "split"))
    path_a, a = checkpoint(str(tmp_path / "unsplit"))
    path_b, b = checkpoint(str(tmp_path / "split"))
    assert path_a.endswith("ckpt-6") and path_b.endswith("ckpt-6") and a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-5, err_msg=name)
