"""tfpar-train with TFDS replaced by tfds.testing.mock_data (random examples of the right
shapes, no download): lets tests run the configs that read tfds:NAME anywhere.

    python tests/scripts/train_with_mock_tfds.py --config=configs/vit_tiny.py --workdir=/tmp/x
"""

import sys

import tensorflow_datasets as tfds

from tfpar import train

if __name__ == "__main__":
    sys.argv[0] = "tfpar-train"
    with tfds.testing.mock_data(num_examples=64):
        train.run()
