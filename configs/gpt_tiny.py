"""The README main job: a tiny byte-level GPT on the embedded stdlib corpus (2 CPU cores, minutes)."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "gpt"
    config.model_args.update(dict(dim=128, depth=2, heads=4, mlp_ratio=4, dropout=0.0))
    config.data.update(dict(name="corpus", seq_len=128))
    config.train.update(dict(steps=600, batch_size=32, steps_per_loop=10, log_every=50,
                             checkpoint_every=200, eval_batch_size=64, eval_examples=4096))
    config.optimizer.update(dict(name="adamw", learning_rate=3e-3, warmup_steps=60))
    return finalize(config)
