"""GPT base (GPT-2 base shape: 12 blocks of 768) for multi-GPU / TPU: bf16, LAMB for large batches."""

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "gpt"
    config.precision = "mixed_bfloat16"
    config.model_args.update(dict(dim=768, depth=12, heads=12, mlp_ratio=4, dropout=0.1))
    config.data.update(dict(name="corpus", seq_len=512))
    config.train.update(dict(steps=100_000, batch_size=1024, steps_per_loop=100, log_every=500,
                             checkpoint_every=5000, eval_batch_size=512))
    config.optimizer.update(dict(name="lamb", learning_rate=2e-3, warmup_steps=5000, weight_decay=0.01))
    return finalize(config)
