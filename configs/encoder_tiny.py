"""A tiny BERT-style encoder classifier on the majority task (offline); any tfds:NAME text set works too."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "encoder"
    config.model_args.update(dict(dim=64, depth=2, heads=4, mlp_ratio=4, dropout=0.0))
    config.data.update(dict(name="task:majority", seq_len=32))
    config.train.update(dict(steps=400, batch_size=64, steps_per_loop=10, log_every=50,
                             checkpoint_every=200, eval_batch_size=100))
    config.optimizer.update(dict(name="adamw", learning_rate=2e-3, warmup_steps=40, label_smoothing=0.1))
    config.sample.length = 0
    return finalize(config)
