"""A model ckptlab has never seen, as a user would write it: `tests/custom_model.py:factory`."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab


class Net(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h.mean(dim=1))


def factory(width: int = 16, depth: int = 4):
    return ckptlab.Workload.custom(
        "tiny-net",
        build_model=lambda: Net(width, depth),
        make_batch=lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)),
        loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
    )
