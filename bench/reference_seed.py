"""The seed of the reference's batch sampler for a data directory, to pass as --data-seed.

    python3 bench/reference_seed.py DATA_PATH

The reference seeds its loader with an FNV-style hash of the shard paths it globs from
DATA_PATH (the path exactly as it is given: the reference does not resolve it), so
windowgpt draws the reference's batches, in its order, with `--data-seed` set to this.
"""
from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

FNV_PRIME = 1099511628211
MASK = 0xFFFFFFFFFFFFFFFF


def reference_data_seed(data_path: str) -> int:
    """The seed the reference's loader derives from the train shards under data_path."""
    seed = 0
    for file in sorted(glob.glob(os.path.join(data_path, "fineweb_train_*.bin"))):
        for byte in str(Path(file)).encode():
            seed = ((seed ^ byte) * FNV_PRIME) & MASK
    return seed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: reference_seed.py DATA_PATH")
    print(reference_data_seed(sys.argv[1]))
