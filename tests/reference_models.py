"""The model PyTorch's own memory estimator is tested on, as a ckptlab workload
(`tests/reference_models.py:sac_ilp_transformer`).

`test/distributed/_tools/test_sac_ilp.py::test_sac_ilp_case1` estimates a 4-layer Transformer
of `torch.testing._internal.distributed._tensor.common_dtensor` (importing that module needs
torch's test dependencies, so it is rebuilt here layer for layer: the same modules, parameters,
ops and order). Its settings: 12 heads, width 768, vocabulary 8192, 1024 positions, dropout 0.1,
a causal SDPA, the output projection tied to the token embedding, loss `model(inp).sum()`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout_p: float):
        super().__init__()
        self.n_heads, self.dropout_p = n_heads, dropout_p
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0, True)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(b, s, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout_p: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads, dropout_p)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim, dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers: int, n_heads: int, vocab_size: int, max_seq_len: int, dim: int,
                 dropout_p: float):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, dropout_p) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(0, tokens.shape[1], device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


SAC_ILP_ARGS = dict(n_layers=4, n_heads=12, vocab_size=8192, max_seq_len=1024, dim=768, dropout_p=0.1)


def output_sum(model, batch):
    """The reference's loss: `model(inp).sum()`."""
    (tokens,) = batch
    return model(tokens).sum()


def sac_ilp_transformer(**overrides):
    args = {**SAC_ILP_ARGS, **overrides}
    return ckptlab.Workload.custom(
        "sac-ilp-transformer",
        build_model=lambda: Transformer(**args),
        make_batch=lambda b, s, gen: (torch.randint(0, args["vocab_size"], (b, s), generator=gen),),
        loss=output_sum,
        blocks="layers",
        max_seq_len=args["max_seq_len"],
    )
