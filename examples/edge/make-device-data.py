"""Give each of N pretend devices its own data: a Dirichlet(0.5) share of Fashion-MNIST in OUT/device<i>/train.npz.

Usage: python make-device-data.py OUT N        (a real device already has its data: skip this)
"""

import sys
from pathlib import Path

import numpy as np

from flower_dlion_app.data import load_fashion_mnist, partition_indices

out, n = Path(sys.argv[1]), int(sys.argv[2])
data = load_fashion_mnist()
for i, rows in enumerate(partition_indices(data.y_train, partitioner="dirichlet", num_partitions=n, alpha=0.5)):
    (out / f"device{i}").mkdir(parents=True, exist_ok=True)
    np.savez(out / f"device{i}" / "train.npz", x=data.x_train[rows], y=data.y_train[rows])
    print(f"{out / f'device{i}' / 'train.npz'}: {rows.size} images")
