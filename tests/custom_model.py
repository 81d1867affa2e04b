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
        loss=classification_loss,
    )


# ----------------------------------------------------------------------------- for the tests' edge cases

class ScheduledNet(Net):
    """Reads tensor data while it is built, as timm's drop-path schedule does."""

    def __init__(self, width: int, depth: int):
        super().__init__(width, depth)
        self.rates = [r.item() for r in torch.linspace(0, 0.1, depth)]


class TwoTowers(nn.Module):
    """Two stacks that find_blocks would take for one each, named explicitly by blocks=."""

    def __init__(self):
        super().__init__()
        self.left = Net(8, 2)
        self.right = Net(8, 3)

    def forward(self, x):
        return self.left(x) + self.right(x)


def _batch(b, s, gen):
    return torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)


def classification_loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def scheduled(depth: int = 3):
    return ckptlab.Workload.custom("scheduled-net", lambda: ScheduledNet(16, depth), _batch, classification_loss)


def two_towers():
    return ckptlab.Workload.custom("two-towers", TwoTowers, _batch, classification_loss,
                                   blocks=["left.layers", "right.layers"])


def without_blocks():
    return ckptlab.Workload.custom("flat", lambda: nn.Sequential(nn.Flatten(1), nn.Linear(8, 3)), _batch,
                                   lambda model, batch: F.cross_entropy(model(batch[0][:, 0]), batch[1]))


def not_a_workload():
    return Net(8, 2)


class WithUnusedParameter(Net):
    """A parameter the loss never reaches: no gradient, so no optimizer state."""

    def __init__(self, width: int, depth: int):
        super().__init__(width, depth)
        self.unused = nn.Linear(width, 64)


class WithReentrantCheckpoint(Net):
    """A layer behind reentrant checkpointing, whose parameters the forward's graph hides."""

    def __init__(self, width: int, depth: int):
        super().__init__(width, depth)
        self.before, self.inner = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = torch.utils.checkpoint.checkpoint(self.inner, self.before(x), use_reentrant=True)
        return super().forward(x)


def unused_parameter():
    return ckptlab.Workload.custom("unused-parameter", lambda: WithUnusedParameter(16, 2), _batch, classification_loss)


def reentrant_checkpoint():
    return ckptlab.Workload.custom("reentrant", lambda: WithReentrantCheckpoint(16, 2), _batch, classification_loss)
