"""Fine-tuning models as users write them: a transformers Llama wrapped by peft's LoRA
(`tests/lora_models.py:lora_llama`), and a model of our own trained in pure bf16
(`tests/lora_models.py:bf16_net`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptlab

VOCAB = 64


def lora_llama(layers: int = 3, use_cache: bool = False, hf_checkpointing: bool = False, dtype: str = "fp32"):
    def build():
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                             attention_dropout=0.1, use_cache=use_cache, bos_token_id=None, eos_token_id=None)
        model = LlamaForCausalLM(config)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        if hf_checkpointing:
            model.gradient_checkpointing_enable()
        return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))

    return ckptlab.Workload.custom("lora-llama", build, _tokens, _causal_loss)


def _tokens(b, s, gen):
    t = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _causal_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    """Float inputs (so the batch is cast too), a frozen input projection."""

    def __init__(self, d=16, n=3):
        super().__init__()
        self.proj = nn.Linear(8, d).requires_grad_(False)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.proj(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(dim=1))


def bf16_net(cast: str = "to"):
    casts = {"to": lambda m: m.to(torch.bfloat16), "bfloat16": lambda m: m.bfloat16(), "half": lambda m: m.half(),
             "none": lambda m: m}
    dtype = {"half": torch.float16, "none": torch.float32}.get(cast, torch.bfloat16)
    return ckptlab.Workload.custom(
        "bf16-net", lambda: casts[cast](Net()),
        lambda b, s, gen: (torch.randn(b, s, 8, generator=gen).to(dtype), torch.randint(0, 3, (b,), generator=gen)),
        lambda model, batch: F.cross_entropy(model(batch[0]).float(), batch[1]))


def reads_numpy():
    """Reads its weights into numpy while it is built: no fake tensor can do that."""
    def build():
        net = Net()
        net.scale = float(net.head.weight.detach().numpy().std())
        return net

    return ckptlab.Workload.custom(
        "numpy-net", build, lambda b, s, gen: (torch.randn(b, s, 8, generator=gen), torch.randint(0, 3, (b,), generator=gen)),
        lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
