"""A wider GPT for the compression benchmark: a step whose gradient, not its compute, is the cost.

gpt_tiny (128 wide, 0.45M parameters) is compute-bound on these CPU cores even at 100 Mbit/s:
its uncompressed step is under 3x its loopback step, so compression cannot show much. This
config keeps the compute per step small (2 blocks, a 64-byte context, 8 sequences per
step) and makes the gradient large (384 wide: ~3.6M parameters, ~14 MB of float32 per
step), so the uncompressed step over a 100 Mbit/s link is many times its loopback step:
the regime where users pick compression. `variant` picks the width (384 or 512).

    python -m tfpar.train --config=configs/gpt_wide.py --workdir=/tmp/wide
    python -m tfpar.train --config=configs/gpt_wide.py:512 --workdir=/tmp/wide512
"""

from tfpar.config import base_config, finalize


def get_config(variant: str = "384"):
    width = int(variant or 384)
    config = base_config()
    config.model = "gpt"
    config.model_args.update(dict(dim=width, depth=2, heads=width // 64, mlp_ratio=4, dropout=0.0))
    config.data.update(dict(name="corpus", seq_len=64))
    config.train.update(dict(steps=600, batch_size=8, steps_per_loop=10, log_every=50,
                             checkpoint_every=200, eval_batch_size=64, eval_examples=2048))
    config.optimizer.update(dict(name="adamw", learning_rate=1e-3, warmup_steps=60))
    return finalize(config)
