"""GPT small (about 11M parameters, 6 blocks of 384) for GPUs/TPUs: bf16, larger batch."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "gpt"
    config.precision = "mixed_bfloat16"
    config.model_args.update(dict(dim=384, depth=6, heads=6, mlp_ratio=4, dropout=0.1))
    config.data.update(dict(name="corpus", seq_len=256))
    config.train.update(dict(steps=20_000, batch_size=256, steps_per_loop=100, log_every=200,
                             checkpoint_every=1000, eval_batch_size=256))
    config.optimizer.update(dict(name="adamw", learning_rate=1e-3, warmup_steps=1000))
    return finalize(config)
