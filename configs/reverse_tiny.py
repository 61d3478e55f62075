"""The algorithmic check: a tiny GPT learns to reverse 8 symbols; exact accuracy reaches 100%."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "gpt"
    config.model_args.update(dict(dim=64, depth=2, heads=4, mlp_ratio=4, dropout=0.0))
    config.data.update(dict(name="task:reverse", seq_len=16))
    config.train.update(dict(steps=1200, batch_size=64, steps_per_loop=20, log_every=100,
                             checkpoint_every=400, eval_batch_size=100))
    config.optimizer.update(dict(name="adamw", learning_rate=3e-3, warmup_steps=50))
    config.sample.length = 0
    return finalize(config)
