"""The model PyTorch's own memory estimator is tested on, as a ckptlab workload
(`tests/reference_models.py:sac_ilp_transformer`), and that estimator run on ckptlab's fake CUDA
step (`pytorch_estimate`). `python tests/reference_models.py` prints the comparison of
docs/measurements.md, "PyTorch's own estimator".

`test/distributed/_tools/test_sac_ilp.py::test_sac_ilp_case1` estimates a 4-layer Transformer
of `torch.testing._internal.distributed._tensor.common_dtensor` (importing that module needs
torch's test dependencies, so it is rebuilt here layer for layer: the same modules, parameters,
ops and order). Its settings: 12 heads, width 768, vocabulary 8192, 1024 positions, dropout 0.1,
a causal SDPA, the output projection tied to the token embedding, loss `model(inp).sum()`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker

import ckptlab
from ckptlab.estimate.cuda_semantics import cuda_semantics
from ckptlab.estimate.fake_mode import new_fake_mode
from ckptlab.estimate.fake_step import fake_model

# test_sac_ilp.py::test_sac_ilp_case1: the peak its estimator gives (asserted there to ±5%),
# for batch 8, seq 1024, fp32, Adam(lr=1e-2, foreach=True).
PYTORCH_PEAK_BYTES = 2_583_888_896
BATCH, SEQ = 8, 1024


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


@dataclass
class PyTorchEstimate:
    """ilp_utils.get_peak_memory_runtime_baseline's terms, at the module that maximises them:
    parameters + gradients accumulated before its backward + activation gradients at its backward
    peak + activations alive after its forward. No optimizer state (that function's docstring)."""

    module: str
    param_bytes: int
    grad_bytes: int
    act_grad_bytes: int
    act_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.act_grad_bytes + self.act_bytes


def pytorch_estimate() -> PyTorchEstimate:
    """test_sac_ilp.py's MemTracker loop (two iterations, the second's stats) and ilp_utils'
    baseline peak, on ckptlab's fake step with CUDA semantics (sm80). Its tensors are CPU
    tensors standing for CUDA ones, so MemTracker's CUDA rounding (512 B) is applied to them."""
    states, refs = mem_tracker._ModState, mem_tracker._MemRefType
    workload = sac_ilp_transformer()
    fake_mode = new_fake_mode()
    model = fake_model(workload, fake_mode)
    info = mem_tracker._WeakRefInfo
    unrounded = info._calculate_mem_consumed
    info._calculate_mem_consumed = lambda self: math.ceil(self.size * self.element_size / 512) * 512
    try:
        with fake_mode, cuda_semantics("sm80"):
            model.train()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
            (inp,) = workload.new_batch(BATCH, SEQ, torch.Generator().manual_seed(0))
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                for iteration in range(2):
                    output = model(inp)  # noqa: F841 (kept alive into the next forward, as there)
                    output.sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if iteration == 0:
                        tracker.reset_mod_stats()
    finally:
        info._calculate_mem_consumed = unrounded
    params = tracker.memory_tracking[model].parameter_mem
    estimates = []
    for stats in tracker.memory_tracking.values():
        snaps = {state: stats.snapshots[state][-1][torch.device("cpu")]
                 for state in (states.PRE_BW, states.PEAK_BW, states.POST_FW)}
        estimates.append(PyTorchEstimate(
            stats.mod_fqn, params, snaps[states.PRE_BW][refs.GRAD],
            snaps[states.PEAK_BW][refs.TEMP] - snaps[states.PRE_BW][refs.TEMP], snaps[states.POST_FW][refs.ACT]))
    return max(estimates, key=lambda e: e.peak_bytes)


if __name__ == "__main__":
    ref = pytorch_estimate()
    pred = ckptlab.predict(sac_ilp_transformer(), BATCH, SEQ, "none", loop="adamw-foreach", device="cuda")
    print(f"PyTorch's test asserts   {PYTORCH_PEAK_BYTES:>15,} B")
    print(f"its estimator on ckptlab's CUDA step {ref.peak_bytes:>15,} B  ({ref.peak_bytes / PYTORCH_PEAK_BYTES - 1:+.4%}), at {ref.module}:")
    for name in ("param_bytes", "grad_bytes", "act_grad_bytes", "act_bytes"):
        print(f"  {name:<16} {getattr(ref, name):>15,}")
    held = ckptlab.predict(sac_ilp_transformer(), BATCH, SEQ, "none", loop="adamw-foreach,holds-output",
                           device="cuda")
    for title, p in (("ckptlab.predict peak_bytes", pred), ("  the loop holding the output", held)):
        print(f"{title} {p.peak_bytes:>15,} B  ({p.peak_bytes / PYTORCH_PEAK_BYTES - 1:+.4%}), {p.peak_phase}, "
              f"attention {p.attention_backend}:")
        for name, value in p.peak_by_category.items():
            if value:
                print(f"  {name:<19} {value:>15,}")
