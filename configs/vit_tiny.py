"""A tiny ViT on TFDS CIFAR-10 (downloads once into data_dir), with random crop + flip."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "vit"
    config.model_args.update(dict(patch_size=4, dim=128, depth=4, heads=4, mlp_ratio=2, dropout=0.1))
    config.data.update(dict(name="tfds:cifar10", augment=True))
    config.train.update(dict(steps=5000, batch_size=128, steps_per_loop=50, log_every=100,
                             checkpoint_every=1000, eval_batch_size=500))
    config.optimizer.update(dict(name="adamw", learning_rate=1e-3, warmup_steps=500,
                                 weight_decay=0.05, label_smoothing=0.1))
    config.sample.length = 0
    return finalize(config)
