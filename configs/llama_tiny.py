"""A keras-hub Llama (tiny, from its config) on the embedded corpus: what --config.model=keras_hub
trains. Split it with --config.parallel.tensor=T (its own get_layout_map), or load a preset
(a keras-hub name, or a directory a backbone's save_to_preset wrote) with
--config.model_args.preset=NAME_OR_DIR."""

import ml_collections

from tfpar.config import base_config, finalize


def get_config():
    config = base_config()
    config.model = "keras_hub"
    config.model_args = ml_collections.ConfigDict(dict(
        backbone="LlamaBackbone", preset="",
        args=dict(num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=128, intermediate_dim=256)))
    config.data.update(dict(name="corpus", seq_len=128))
    config.train.update(dict(steps=600, batch_size=32, steps_per_loop=10, log_every=50,
                             checkpoint_every=200, eval_batch_size=64, eval_examples=4096))
    config.optimizer.update(dict(name="adamw", learning_rate=3e-3, warmup_steps=60))
    return finalize(config)
