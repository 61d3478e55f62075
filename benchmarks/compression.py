"""Benchmark: gradient compression on 2 and 4 workers: loss at equal steps, bytes, time to quality.

    python benchmarks/compression.py --links=loopback --steps=100      # no root needed
    python benchmarks/compression.py                                   # loopback + 100 Mbit/s (root)
    python benchmarks/compression.py --suite=time_to_quality                  # time to quality, 33 min (root)
    # equal steps against the committed none (not trained again):
    python benchmarks/compression.py --model=gpt_tiny --links=loopback --workers=2 --steps=600 \
        --reference=benchmarks/results/compression/tiny_600.json --eval-every=100 \
        --configs="onebit_adam,dgc_adam(0.01)+all+freeze60+momentum0" --name=my_run

Writes OUT/NAME.json and OUT/NAME.png (default OUT: benchmarks/results) and prints a table.
The parts live in benchmarks/compression_bench/ (its docstring says what each holds); the
measured tables are in benchmarks/results/compression/README.md.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# what benchmarks/gpu_steps.py uses (`import compression as bench`)
from compression_bench.configs import (CONFIGS, REPO, compression_for, flags,  # noqa: E402
                                       optimizer_config)

__all__ = ["CONFIGS", "REPO", "compression_for", "flags", "optimizer_config"]

if __name__ == "__main__":
    from compression_bench.cli import main

    main(__doc__.splitlines()[0])
