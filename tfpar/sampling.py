"""Generate text from a byte-level GPT: temperature sampling over a sliding window.

Example:
    >>> generate(model, prompt="def ", length=200, temperature=0.8, seed=0)
    'def __init__(self, ...'
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def generate(model, prompt: str, length: int, max_len: int, temperature: float = 0.8,
             seed: int = 0) -> str:
    """`prompt` followed by `length` sampled bytes (decoded with errors replaced)."""
    rng = np.random.default_rng(seed)
    tokens = list(prompt.encode("utf-8")) or [ord("\n")]

    @tf.function(reduce_retracing=True)
    def next_logits(window, position):
        logits = model(window, training=False)
        return tf.cast(logits[0, position], tf.float32)

    for _ in range(length):
        context = tokens[-max_len:]
        window = np.zeros((1, max_len), np.int32)
        window[0, : len(context)] = context
        logits = next_logits(tf.constant(window), tf.constant(len(context) - 1)).numpy()
        if temperature <= 0:
            token = int(np.argmax(logits))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            token = int(rng.choice(len(p), p=p / p.sum()))
        tokens.append(token)
    return bytes(tokens).decode("utf-8", errors="replace")
