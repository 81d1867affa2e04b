"""The GPU validation's CPU-side logic and its refusal without a GPU."""

import subprocess
import sys

import pandas as pd
import pytest
import torch

from ckptlab.apps import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_it_fails_with_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckptlab.apps.gpu_check"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no CUDA device is available" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_allocator_ratio_and_band():
    df = pd.DataFrame([
        dict(cell_id="a", status="ok", peak_bytes=95, cuda_max_allocated_bytes=100, cuda_max_reserved_bytes=120),
        dict(cell_id="b", status="ok", peak_bytes=30, cuda_max_allocated_bytes=100, cuda_max_reserved_bytes=120),
        dict(cell_id="c", status="oom", peak_bytes=None, cuda_max_allocated_bytes=None, cuda_max_reserved_bytes=None),
    ])
    r = gpu_check.allocator_ratios(df).set_index("cell_id")
    assert list(r.index) == ["a", "b"]
    assert r.loc["a", "tracker_vs_allocator"] == pytest.approx(0.95) and r.loc["a", "in_band"]
    assert not r.loc["b", "in_band"]
    assert gpu_check.run_dir_name("NVIDIA H100 80GB HBM3") == "gpu-check-nvidia-h100-80gb-hbm3"


def test_grid_is_valid_for_cuda_shape(tmp_path):
    from ckptlab.run.config import SweepConfig
    kw = {k: v for k, v in gpu_check.GRID.items() if k not in ("device",)}
    grid = SweepConfig(**kw, device="cpu", out=tmp_path)  # validates every value except the device
    assert len(grid.cells()) == 40 and grid.seq_lens == [1024]
