"""How often is the Lion mix β₁·m + (1−β₁)·g exactly zero? ReLU vs SiLU on the shipped CNN.

A 1-bit sign cannot carry sign(0) = 0 (flower-dlion sends a coin flip), so a model whose
gradients are often exactly zero drifts from Lion. Runs single-worker Lion (lr 2e-3, wd 0.1)
on Fashion-MNIST minibatches and counts exact zeros in g and in the mix.

    .venv/bin/python benchmarks/zero_signs.py
"""

import numpy as np
import torch
from torch import nn

from flower_dlion import lion
from flower_dlion_app.data import load_fashion_mnist, to_tensor
from flower_dlion_app.model import Net, flat_gradient, flat_parameters


def main() -> None:
    ds = load_fashion_mnist()
    print("activation  batch  round  zeros_in_g  zeros_in_mix  (of d)")
    for activation in (nn.ReLU, nn.SiLU):
        for batch in (16, 64):
            torch.manual_seed(0)
            model = Net(activation=activation)
            x = flat_parameters(model)
            m = torch.zeros_like(x)
            for rnd in range(1, 40):
                rows = np.random.default_rng(rnd).choice(len(ds.y_train), batch, replace=False)
                _, g = flat_gradient(model, x, to_tensor(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows]))
                mix = m * 0.9 + 0.1 * g
                if rnd in (1, 10, 39):
                    zg, zm = int((g == 0).sum()), int((mix == 0).sum())
                    print(
                        f"{activation.__name__:10s}  {batch:5d}  {rnd:5d}  {zg:7d} ({zg / x.numel():5.1%})"
                        f"  {zm:7d} ({zm / x.numel():5.1%})  {x.numel()}"
                    )
                lion.lion_step_(x, m, g, lr=2e-3, weight_decay=0.1, beta1=0.9, beta2=0.99)


if __name__ == "__main__":
    main()
