"""A two-block language model small enough that what a loop adds can be derived by hand from its
shapes: an embedding of `vocab` tokens, two residual tanh blocks of `width`, a head. With
`returns_dict` it returns the logits and the last hidden state in a dict, as a transformers model
does."""

import functools

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, returns_dict: bool = False):
        super().__init__()
        self.returns_dict = returns_dict
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return {"logits": logits, "hidden": h} if self.returns_dict else logits


def tiny_lm_factory(vocab: int, width: int, returns_dict: bool = False):
    """A factory of `TinyLM(vocab, width, returns_dict)` taking no arguments, as a workload's is."""
    return functools.partial(TinyLM, vocab, width, returns_dict)
