import torch, torch.nn as nn
import ckptlab

class Net(nn.Module):  # any model with a stack of repeated blocks (nn.ModuleList / nn.Sequential)
    def __init__(self, width, depth):
        super().__init__()
        mlp = lambda: nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.layers = nn.ModuleList(mlp() for _ in range(depth))
    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x

def energy(model, batch):  # your training step's loss
    return model(batch[0]).pow(2).mean()

def factory(width: int = 128, depth: int = 8):  # keyword arguments: --set width=512
    return ckptlab.Workload.custom("my-net", build_model=lambda: Net(width, depth), loss=energy,
        make_batch=lambda batch_size, seq_len, gen: (torch.randn(batch_size, seq_len, width, generator=gen),))
