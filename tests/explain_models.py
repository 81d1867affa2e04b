"""Token models for `explain`'s tests, each sized so that one thing holds the peak:
`tests/explain_models.py:factory` with width, depth and vocab as overrides."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ckptlab


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TokenModel(nn.Module):
    """Embedding, `depth` residual MLP blocks, a head over `vocab` tokens. `own_checkpoint`: the
    model recomputes its blocks itself, as transformers' gradient checkpointing does."""

    def __init__(self, width: int, depth: int, vocab: int, frozen_embedding: bool, own_checkpoint: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.embed.weight.requires_grad_(not frozen_embedding)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.own_checkpoint = own_checkpoint

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.own_checkpoint else block(x)
        return self.head(x)


def factory(width: int = 32, depth: int = 2, vocab: int = 16, frozen_embedding: bool = False,
            own_checkpoint: bool = False):
    def batch(batch_size, seq_len, gen):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(model, batch):
        logits = model(batch[0])
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    return ckptlab.Workload.custom("token-model", lambda: TokenModel(width, depth, vocab, frozen_embedding,
                                                                     own_checkpoint), batch, loss)
