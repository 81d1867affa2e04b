"""CUDA semantics on CPU fake tensors: each rule of estimate.cuda_semantics / cuda_autocast on a
tiny step, its bytes counted by hand from the CUDA kernels' allocations."""

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlab import apply_checkpointing, get_workload, track_memory
from ckptlab.checkpoint.wrap import selective_context_fn
from ckptlab.estimate.cuda_autocast import cuda_autocast, cuda_autocast_policies
from ckptlab.estimate.cuda_semantics import cuda_semantics
from ckptlab.estimate.fake_step import fake_model

B, H, S, D = 2, 4, 64, 16
BF16 = torch.bfloat16


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def _leaves(*shapes, dtype=BF16):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def _attention_step(dtype=BF16, dropout_p=0.1, shape=(B, H, S, D), kv_heads=None, **semantics):
    """One SDPA layer tracked: q, k, v made in forward (clones, which keep nothing for backward),
    attention, a sum as the loss. Returns (report, CudaSemantics)."""
    kv_shape = (shape[0], kv_heads or shape[1], *shape[2:])
    with FakeTensorMode():
        qb, kb, vb = _leaves(shape, kv_shape, kv_shape, dtype=dtype)
        with cuda_semantics(**semantics) as cuda, track_memory() as tracker:
            q, k, v = qb.clone(), kb.clone(), vb.clone()
            loss = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  enable_gqa=kv_heads is not None).sum()
            tracker.phase("backward")
            loss.backward()
        return tracker.report(), cuda


def test_flash_keeps_q_k_v_out_logsumexp_and_its_rng_state_by_hand():
    report, cuda = _attention_step()
    assert cuda.attention_backend == "flash" and cuda.backend_calls == {"flash": 1}
    qkv_out = 4 * B * H * S * D * 2          # q, k, v and the output, bf16
    lse = B * H * S * 4                      # logsumexp, fp32 [b, h, s_q]
    rng = 2 * 8 + 8                          # rng_state uint64[2] and the unused uint64 scalar
    loss = 2                                 # the bf16 loss, alive when forward ends
    assert report.saved_activation_bytes == qkv_out + lse + rng + loss
    # Backward's peak: what forward kept, the loss's grad (a 0-d bf16 expanded), dout made
    # contiguous as [b, s, h, d], the output made so too (a copy: it has the [b, h, s, d] layout of
    # the cloned q), dq, dk, dv, softmax_d fp32 [b, h, s_q rounded to 128] and the fp32 dq
    # accumulator [b, s_q rounded to 128, h, d rounded to 32] (cuda/attention_backward.cu:82-83,
    # cuda/flash_attn/flash_api.cpp:934, :939, :881-882 at v2.6.0).
    s128, d32 = 128, 32
    backward = (2 + 2 * B * S * H * D * 2 + 3 * B * H * S * D * 2 + B * H * s128 * 4
                + B * s128 * H * d32 * 4)
    assert report.peak_phase == "backward"
    assert report.peak_bytes == report.saved_activation_bytes + backward


def test_flash_backward_with_grouped_query_attention_expands_dk_dv_before_the_sum():
    hk = 2
    report, cuda = _attention_step(kv_heads=hk)
    assert cuda.attention_backend == "flash"
    q_bytes, kv_bytes = B * H * S * D * 2, B * hk * S * D * 2
    kept = 2 * q_bytes + 2 * kv_bytes + B * H * S * 4 + 24 + 2     # q, out, k, v, lse, rng, loss
    assert report.saved_activation_bytes == kept
    # dout, the output made contiguous as [b, s, h, d] (a copy), dq, dk, dv, softmax_d, the dq
    # accumulator, and dk, dv per query head (flash_api.cpp:950-951, summed at :1011-1012, v2.6.0)
    backward = 2 + 3 * q_bytes + 2 * kv_bytes + B * H * 128 * 4 + B * 128 * H * 32 * 4 + 2 * q_bytes
    assert report.peak_bytes == kept + backward


def test_flash_pads_a_head_dim_to_a_multiple_of_8_and_keeps_the_padded_copies():
    d = 12
    report, _ = _attention_step(shape=(B, H, S, d))
    clones = 3 * B * H * S * d * 2                 # the unpadded q, k, v (the test's locals)
    padded = 4 * B * H * S * 16 * 2                # padded q, k, v and the padded output
    assert report.saved_activation_bytes == clones + padded + B * H * S * 4 + 24 + 2


def test_flash_without_dropout_on_a_small_batch_splits_the_keys_in_fp32_buffers():
    # b*h*ceil(s/64) = 32 blocks fill 15% of an A100's 2 x 108 slots; the 4 blocks of 256 keys
    # split 4 ways (flash_api.cpp:262 num_splits_heuristic), into fp32 [4, b, h, s] and
    # [4, b, h, s, d] buffers (:318-319, set_params_splitkv, at v2.6.0).
    b, h, s, d = 1, 2, 1024, 64
    report, _ = _attention_step(dropout_p=0.0, shape=(b, h, s, d))
    kept = 4 * b * h * s * d * 2 + b * h * s * 4 + 24
    assert report.peak_phase == "forward"
    assert report.peak_bytes == kept + 4 * b * h * s * 4 + 4 * b * h * s * d * 4
    # an H100's 132 SMs split it the same; a batch of 8 fills an A100 and does not split
    assert _attention_step(dropout_p=0.0, shape=(8, h, s, d))[0].peak_phase == "backward"


def test_efficient_keeps_a_logsumexp_padded_to_32_and_no_device_seed():
    s = 48  # padded to 64 in the logsumexp (kAlignLSE); seed and offset are host scalars
    report, cuda = _attention_step(dtype=torch.float32, shape=(B, H, s, D))
    assert cuda.attention_backend == "efficient"
    kept = 4 * B * H * s * D * 4 + B * H * 64 * 4 + 4
    assert report.saved_activation_bytes == kept
    # backward: the loss's grad, dout made contiguous (the grad of a sum is an expanded scalar),
    # dq, dk, dv, delta fp32 [b, h, s_q] and the workspace. fp32 with
    # d <= 32 runs the 64 x 64 k32 kernel (kBlockSizeI = kBlockSizeJ = 64); fp32 stages no dk, dv,
    # so the workspace is the dq accumulator's tiles: per (b, h), ceil(s_q / I) x ceil(d / J)
    # tiles of a 16-byte header and I x J fp32s, the (b, h) stride rounded up to 16 bytes
    # (cuda/mem_eff_attention/kernel_backward.h:879-886 workspace_strideBH, workspace_size at v2.6.0).
    # The seed and offset are CPU scalars outside graph capture (cuda/attention.cu:1098, :1125).
    I, J, header = 64, 64, 16
    tile = header + I * J * 4
    per_bh = round_up(math.ceil(s / I) * math.ceil(D / J) * tile, 16)   # 1 tile: 16400 bytes
    assert report.peak_bytes == kept + 4 + 4 * B * H * s * D * 4 + B * H * s * 4 + B * H * per_bh


def _efficient_backward_peak(dtype, shape, **semantics):
    """(peak bytes - what forward kept - the loss's grad - dout, dq, dk, dv - delta) of a causal
    efficient attention with dropout 0.1: the workspace, the one backward buffer left."""
    b, h, s, d = shape
    report, cuda = _attention_step(dtype=dtype, shape=shape, attention="efficient", **semantics)
    assert cuda.attention_backend == "efficient" and report.peak_phase == "backward"
    size = torch.finfo(dtype).bits // 8
    return report.peak_bytes - report.saved_activation_bytes - size - 4 * b * h * s * d * size - b * h * s * 4


def test_efficient_backward_bf16_head_dim_128_uses_128_x_128_dq_tiles():
    # bf16, dropout, max(d, d_v) = 128 on sm80: the first kernel of dispatch_cutlassB_bf16_sm80
    # (mem_eff_attention/kernels/cutlassB.h:227 at v2.6.0) that fits is 128 x 128 k128 with dropout.
    # kMaxK 128 <= kBlockSizeI 128: dk, dv stay in registers (kOutputInRF), so only dq's tiles:
    # ceil(64 / 128) x ceil(128 / 128) = 1 tile of 16 + 128 * 128 * 4 = 65552 bytes per (b, h). (The
    # 64 x 64 approximation said 2 x 16400.)
    b, h, s, d = 2, 4, 64, 128
    I, J, header = 128, 128, 16
    per_bh = round_up(math.ceil(s / I) * math.ceil(d / J) * (header + I * J * 4), 16)
    assert per_bh == 65552
    assert _efficient_backward_peak(BF16, (b, h, s, d)) == b * h * per_bh


def test_efficient_backward_on_sm86_stages_dk_dv_and_splits_the_keys():
    # sm86 gives a block 99 KiB of shared memory: the 128 x 128 k128 dropout kernel (159 KiB)
    # does not fit, so bf16 d = 128 runs 64 x 64 k128. kMaxK 128 > kBlockSizeI 64: dk and dv
    # are staged in fp32 (kNeedsAccumGradK / V), num_splits_key times over. Keys split in
    # ceil(256 / J) = 4, capped at 200 // (b * h) = 25: 4 (cuda/attention_backward.cu:655-678 at
    # v2.6.0). Per (b, h), in fp32s:
    #   dk: splits * J * round_up(d, I)  = 4 * 64 * 128 = 32768
    #   dv: splits * J * round_up(dv, I) = 4 * 64 * 128 = 32768
    #   dq: ceil(256 / 64) * ceil(128 / 64) tiles * (4 + 64 * 64) = 8 * 4100 = 32800
    # 98336 fp32s = 393344 bytes per (b, h). (The approximation said 8 x 16400 = 131200.)
    b, h, s, d = 2, 4, 256, 128
    I, J, header_floats = 64, 64, 4
    splits = min(math.ceil(s / J), 200 // (b * h))
    staging = 2 * splits * J * round_up(d, I)
    dq_tiles = math.ceil(s / I) * math.ceil(d / J) * (header_floats + I * J)
    per_bh = round_up(staging + dq_tiles, 4) * 4
    assert per_bh == 393344
    assert _efficient_backward_peak(BF16, (b, h, s, d), arch="sm86") == b * h * per_bh


def test_math_on_cuda_materialises_fp32_scores_and_a_bool_dropout_mask():
    report, cuda = _attention_step(attention="math")
    assert cuda.attention_backend == "math"
    # the bf16 q, k, v; their fp32 upcasts as matmul keeps them (q and k^T scaled, v); the fp32
    # probabilities softmax keeps, the bool dropout mask and the dropped probabilities; the loss
    # (attention.cpp:792-881 _scaled_dot_product_attention_math, native/Dropout.cpp:132-139, v2.6.0)
    bhsd, bhss = B * H * S * D, B * H * S * S
    assert report.saved_activation_bytes == 3 * bhsd * 2 + 3 * bhsd * 4 + bhss * (4 + 1 + 4) + 2


def test_checkpoint_keeps_its_rng_states_off_the_device():
    # torch.utils.checkpoint stashes torch.get_rng_state() (CPU) and, on CUDA, the Philox state
    # from torch.cuda.get_rng_state(), a 16-byte CPU tensor: none of it is device memory, and
    # the fake step counts none of it either (torch/utils/checkpoint.py:247, :190 at v2.13.0;
    # aten/src/ATen/cuda/CUDAGeneratorImpl.cpp:323-327 get_state at v2.6.0).
    with FakeTensorMode():
        (x,) = _leaves((4, 64), dtype=torch.float32)
        with cuda_semantics(), track_memory() as tracker:
            h = x.clone()
            y = torch.utils.checkpoint.checkpoint(lambda t: F.dropout(t, 0.1, True), h, use_reentrant=False)
            tracker.phase("backward")
            y.sum().backward()
    assert tracker.report().saved_activation_bytes == 2 * 4 * 64 * 4  # h and y, nothing else


def _backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, **semantics):
    with FakeTensorMode(), cuda_semantics(**semantics) as cuda:
        q, k, v = (t.detach().requires_grad_() for t in (q(), k(), v()))
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask() if attn_mask else None, dropout_p=dropout_p,
                                       is_causal=is_causal, enable_gqa=enable_gqa)
        return cuda.attention_backend


def _t(*shape, dtype=BF16):
    return lambda: torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("case, expected", [
    (dict(q=_t(2, 4, 8, 16, dtype=torch.float32), k=_t(2, 4, 8, 16, dtype=torch.float32),
          v=_t(2, 4, 8, 16, dtype=torch.float32)), "efficient"),
    (dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 8, 16), v=_t(2, 4, 8, 16), dropout_p=0.1, is_causal=True), "flash"),
    (dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 8, 16), v=_t(2, 4, 8, 16), attn_mask=lambda: torch.ones(8, 8, dtype=bool)),
     "efficient"),
    (dict(q=_t(2, 4, 8, 300), k=_t(2, 4, 8, 300), v=_t(2, 4, 8, 300)), "math"),     # > 256, not a multiple of 8
    (dict(q=_t(2, 4, 8, 16), k=_t(2, 2, 8, 16), v=_t(2, 2, 8, 16), enable_gqa=True), "flash"),
    (dict(q=_t(2, 4, 8, 16, dtype=torch.float32), k=_t(2, 2, 8, 16, dtype=torch.float32),
          v=_t(2, 2, 8, 16, dtype=torch.float32), enable_gqa=True), "math"),       # efficient has no GQA in 2.11
    (dict(q=_t(2, 4, 8, 224), k=_t(2, 4, 8, 224), v=_t(2, 4, 8, 224), arch="sm86"), "efficient"),
    (dict(q=_t(2, 4, 8, 224), k=_t(2, 4, 8, 224), v=_t(2, 4, 8, 224), arch="sm80"), "flash"),
])
def test_backend_choice_follows_pytorchs_cuda_rules(case, expected):
    assert _backend(**case) == expected


def test_an_impossible_override_is_refused_naming_why():
    fp32 = dict(q=_t(2, 4, 8, 16, dtype=torch.float32), k=_t(2, 4, 8, 16, dtype=torch.float32),
                v=_t(2, 4, 8, 16, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"attention='flash' is impossible.*fp16 or bf16.*allowed here: efficient, math"):
        _backend(**fp32, attention="flash")
    assert _backend(**fp32, attention="math") == "math"
    with pytest.raises(ValueError, match="attention='fast' is invalid: allowed are flash, efficient, math"):
        _backend(**fp32, attention="fast")
    with pytest.raises(ValueError, match="arch='sm70' is invalid"):
        _backend(**fp32, arch="sm70")
    with cuda_semantics(), pytest.raises(ValueError, match="on fake tensors"):  # real kernels are not modelled
        F.scaled_dot_product_attention(*(torch.zeros(1, 1, 8, 8) for _ in range(3)))


def test_outside_the_mode_attention_and_dropout_are_the_cpus_again():
    with cuda_semantics():
        pass
    with FakeTensorMode():
        (x,) = _leaves((4, 8), dtype=torch.float32)
        assert F.dropout(x, 0.1, True).grad_fn.name() == "MulBackward0"
        q = x.view(1, 1, 4, 8)
        assert F.scaled_dot_product_attention(q, q, q).grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"


@pytest.mark.parametrize("cuda, mask_bytes_per_element", [(True, 1), (False, 4)])
def test_dropout_keeps_a_bool_mask_on_cuda_and_one_of_the_input_dtype_on_cpu(cuda, mask_bytes_per_element):
    n = 4 * 64
    with FakeTensorMode():
        (x,) = _leaves((4, 64), dtype=torch.float32)
        drop = nn.Dropout(0.1)
        with cuda_semantics() if cuda else contextlib.nullcontext(), track_memory() as tracker:
            y = drop(x.clone())
            tracker.phase("backward")
            y.sum().backward()
        assert y.grad_fn.name() == ("NativeDropoutBackward0" if cuda else "MulBackward0")
    # kept: the output (alive) and the mask
    assert tracker.report().saved_activation_bytes == n * 4 + n * mask_bytes_per_element


def _node_names(node) -> set:
    names, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            todo.extend(f for f, _ in node.next_functions)
    return names


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func.__name__, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


def test_cuda_autocast_runs_norms_and_softmax_in_fp32_matmuls_in_bf16_and_caches_weight_casts():
    with FakeTensorMode():
        lin, ln = nn.Linear(16, 16), nn.LayerNorm(16)
        x = torch.randn(2, 8, 16)
        with cuda_autocast(BF16), _Ops() as ops:
            y = lin(x)
            assert (y.dtype, ln(y).dtype, torch.softmax(y, -1).dtype, F.log_softmax(y, -1).dtype) == (
                BF16, torch.float32, torch.float32, torch.float32)
            assert (y @ y.transpose(1, 2)).dtype == BF16 and y.pow(2).dtype == torch.float32
            assert "ToCopyBackward0" in _node_names(y.grad_fn)  # the weight's cast, recorded by autograd
            lin(x)
        weight_casts = [c for c in ops.calls if c == ("_to_copy.default", BF16)]
        assert len(weight_casts) == 2 + 2  # weight and bias once each for two calls; x twice
        with torch.autocast("cpu", dtype=BF16):  # CPU autocast is CPU's again outside
            assert ln(lin(x)).dtype == BF16
    with pytest.raises(ValueError, match="dtype=torch.float32 is invalid"):
        with cuda_autocast(torch.float32):
            pass


@pytest.mark.parametrize("context_fn, extra", [(None, 0), (selective_context_fn("attn"), B * H * S * 4 + 24)])
def test_selective_checkpointing_saves_the_fused_kernel_as_on_a_gpu(context_fn, extra):
    # full: the region keeps its inputs and returns the output; selective keeps the flash op's
    # outputs (it names _scaled_dot_product_flash_attention): the logsumexp and rng state besides
    kwargs = {"context_fn": context_fn} if context_fn else {}
    with FakeTensorMode():
        qb, kb, vb = _leaves((B, H, S, D), (B, H, S, D), (B, H, S, D))
        with cuda_semantics(), track_memory() as tracker:
            q, k, v = qb.clone(), kb.clone(), vb.clone()
            out = torch.utils.checkpoint.checkpoint(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True), q, k, v,
                use_reentrant=False, **kwargs)
            tracker.phase("backward")
            out.sum().backward()
    assert tracker.report().saved_activation_bytes == 4 * B * H * S * D * 2 + extra


def test_checkpoint_recompute_runs_under_the_mode_with_the_same_backend():
    workload = get_workload("gpt-tiny", n_layer=2, n_embd=64, n_head=4)
    fake_mode = FakeTensorMode()
    model = fake_model(workload, fake_mode)
    with fake_mode:
        handle = apply_checkpointing(model, "full")
        batch = workload.new_batch(2, 32, torch.Generator().manual_seed(0))
        with cuda_semantics() as cuda, track_memory(model, inputs=batch) as tracker:
            with cuda_autocast(BF16):
                loss = workload.loss(model, batch)
            tracker.phase("backward")
            loss.backward()
        assert handle.recompute_count == 2
        assert all(p.grad is not None for p in model.parameters())
    assert cuda.backend_calls == {"flash": 4}  # two blocks' forwards and their recomputations
    assert tracker.report().peak_bytes > 0


# ---------------------------------------------------------------------------- per torch version

@pytest.mark.parametrize("arch, torch_version, expected", [
    ("sm90", "2.8", "flash"),    # priority_order: the constexpr {flash, efficient, math, cudnn}
    ("sm90", "2.9", "cudnn"),    # check_prefer_cudnn_attention: CUDNN_VERSION >= 90900, major 9, minor 0
    ("sm90", "2.10", "flash"),   # runtime cuDNN must be > 9.15.00; its wheel's is 9.10.2
    ("sm90", "2.11", "cudnn"),   # its wheel's cuDNN (9.19) is past 9.15
    ("sm90", "2.13", "cudnn"),
    ("sm80", "2.13", "flash"),   # not major 9 or 10: flash, efficient, math, cudnn
    ("sm89", "2.11", "flash"),
])
def test_the_backend_order_follows_the_torch_version_and_the_card(arch, torch_version, expected):
    qkv = {n: _t(2, 4, 8, 64) for n in "qkv"}
    assert _backend(**qkv, is_causal=True, arch=arch, torch_version=torch_version) == expected


def test_cudnn_keeps_q_k_v_out_logsumexp_and_philox_scalars_and_a_dq_accumulator_by_hand():
    # torch 2.13 on sm90 puts cuDNN first; a dropout of 1/16 is one it takes (sixteenths).
    report, cuda = _attention_step(dropout_p=1 / 16, arch="sm90", torch_version="2.13")
    assert cuda.attention_backend == "cudnn"
    bhsd = B * H * S * D
    # q, k, v, the output (in q's [b, h, s, d] layout), logsumexp fp32 [b, h, s_q, 1], the Philox
    # seed and offset as two int64 scalars on the device, and the bf16 loss (aten/src/ATen/native/
    # cudnn/MHA.cpp:639, :644; cuda/attention.cu:790-791 at v2.6.0)
    kept = 4 * bhsd * 2 + B * H * S * 4 + 2 * 8 + 2
    assert report.saved_activation_bytes == kept
    # backward: the loss's grad (0-d bf16), dout copied in the output's layout (the grad of a sum
    # has an innermost stride of 0: permute_to_matching_layout, MHA.cpp:761-764 at v2.6.0), dq, dk,
    # dv, and the workspace:
    # an fp32 dQ accumulator [b, s_q, h, d] and an fp32 softmax sum [b, h, s_q]
    backward = 2 + bhsd * 2 + 3 * bhsd * 2 + bhsd * 4 + B * H * S * 4
    assert report.peak_phase == "backward" and report.peak_bytes == kept + backward


def test_cudnn_refusals_per_torch_version_and_card():
    qkv = {n: _t(2, 4, 8, 64) for n in "qkv"}
    # check_cudnn_dropout (from 2.12; sdp_utils.cpp, no tag source): 0.1 is not a multiple of
    # 1/16; 2.11 takes it
    with pytest.raises(ValueError, match="dropout probability in sixteenths"):
        _backend(**qkv, dropout_p=0.1, arch="sm90", torch_version="2.12", attention="cudnn")
    assert _backend(**qkv, dropout_p=0.1, arch="sm90", torch_version="2.11") == "cudnn"
    # so a dropout of 0.1 on 2.13 goes to flash, the next in sm90's order
    assert _backend(**qkv, dropout_p=0.1, arch="sm90", torch_version="2.13") == "flash"
    # head dim 256: within cuDNN 9.10's limit on sm90, beyond the 128 of other cards
    d256 = {n: _t(2, 4, 8, 256) for n in "qkv"}
    assert _backend(**d256, arch="sm90", torch_version="2.13") == "cudnn"
    with pytest.raises(ValueError, match="at most 128"):
        _backend(**d256, arch="sm80", torch_version="2.13", attention="cudnn")
    # torch 2.4 runs cuDNN attention only with TORCH_CUDNN_SDPA_ENABLED=1 (#128539, no tag source):
    # refused before any call
    with pytest.raises(ValueError, match=r"attention='cudnn' is invalid with torch_version='2.4'"):
        with cuda_semantics(attention="cudnn", torch_version="2.4"):
            pass
    with pytest.raises(ValueError, match=r"torch_version='2.3' is invalid: allowed are 2.4, 2.5"):
        with cuda_semantics(torch_version="2.3"):
            pass


def test_torch_2_4_has_no_enable_gqa_so_keys_and_values_are_repeated_first():
    # transformers' repeat_kv for torch < 2.5 (no enable_gqa: native_functions.yaml:14677 at
    # v2.4.0): k and v expanded to the query's heads and copied, then flash attention without
    # grouped-query attention (no per-query-head dk, dv expansion).
    hk = 2
    report, cuda = _attention_step(kv_heads=hk, torch_version="2.4")
    assert cuda.attention_backend == "flash"
    q_bytes, kv_bytes = B * H * S * D * 2, B * hk * S * D * 2
    # q, out, the k, v clones (the test's locals), their repeated copies, lse, loss; 2.4's
    # philox_seed and philox_offset are host scalars (no device bytes, test_flash_rng_state_...)
    assert report.saved_activation_bytes == 2 * q_bytes + 2 * kv_bytes + 2 * q_bytes + B * H * S * 4 + 2


def _flash_step(q_layout: str):
    """A flash attention step whose q, k, v have the [b, h, s, d] layout ("bhsd": made contiguous)
    or the [b, s, h, d] one ("bshd": a projection viewed and transposed): (report, out strides,
    q strides)."""
    with FakeTensorMode():
        shape = (B, H, S, D) if q_layout == "bhsd" else (B, S, H, D)
        leaves = _leaves(shape, shape, shape)
        with cuda_semantics(), track_memory() as tracker:
            q, k, v = (t.clone() if q_layout == "bhsd" else t.clone().transpose(1, 2) for t in leaves)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
            strides = out.stride(), q.stride()
            loss = out.sum()
            tracker.phase("backward")
            loss.backward()
    return tracker.report(), *strides


def test_flash_output_takes_the_layout_of_the_query():
    # mha_fwd: out = empty_like(q) of the [b, s, h, d] view (flash_api.cpp:439 at v2.6.0);
    # _flash_attention_backward then makes out.contiguous() of that view (attention_backward.cu:83):
    # no copy when out is [b, s, h, d] memory, a copy of B*H*S*D bf16 elements when it is
    # [b, h, s, d] memory.
    bshd, out_strides, q_strides = _flash_step("bshd")
    assert out_strides == q_strides == (S * H * D, D, H * D, 1)
    bhsd, out_strides, q_strides = _flash_step("bhsd")
    assert out_strides == q_strides == (H * S * D, S * D, D, 1)
    assert bhsd.saved_activation_bytes == bshd.saved_activation_bytes
    assert bhsd.peak_bytes - bshd.peak_bytes == B * H * S * D * 2


def test_efficient_mask_is_padded_as_given_then_expanded_as_a_view():
    # fp32 runs memory-efficient attention. A [b, 1, 1, s_k] bool padding mask becomes an fp32
    # additive mask of its own shape; its strides (s_k, s_k, s_k, 1) are not multiples of 8 for
    # s_k = 20, so pad_bias pads the last dim to 24 and slices it back, and the [b, h, s_q, s_k]
    # mask the kernel keeps is a view of those b * 24 floats. At s_k = 24 no padding is needed.
    # (attention.cpp:574-589 preprocess_mask, :567 pad_bias, :557 aligned_tensor at v2.6.0.)
    def kept(s):
        with FakeTensorMode():
            q, k, v = _leaves((B, H, s, D), (B, H, s, D), (B, H, s, D), dtype=torch.float32)
            mask = torch.ones(B, 1, 1, s, dtype=torch.bool)
            with cuda_semantics() as cuda, track_memory() as tracker:
                q2, k2, v2 = q.clone(), k.clone(), v.clone()
                loss = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask).sum()
                tracker.phase("backward")
                loss.backward()
        assert cuda.attention_backend == "efficient"
        return tracker.report().saved_activation_bytes
    for s, padded in ((20, 24), (24, 24)):
        # q, k, v (clones) and the output, fp32; logsumexp fp32 [b, h, s_q rounded to 32]; the
        # mask's storage; the fp32 loss
        assert kept(s) == 4 * B * H * s * D * 4 + B * H * round_up(s, 32) * 4 + B * padded * 4 + 4


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # 2.11's composite path, torch's own
@pytest.mark.parametrize("torch_version, out_dtype", [("2.11", BF16), ("2.12", torch.float32), ("2.13", torch.float32)])
def test_rms_norm_runs_in_fp32_under_cuda_autocast_from_torch_2_12(torch_version, out_dtype):
    # autocast_mode.h:876 (AT_FORALL_FP32) lists rms_norm at v2.12.0, not at v2.11.0 (:855): the
    # bf16 activation is cast to an
    # fp32 copy and the norm's output stays fp32 (4 bytes an element, where 2.11's composite casts
    # its result back to the input's bf16).
    with FakeTensorMode():
        norm = nn.RMSNorm(64)
        x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
        with cuda_autocast_policies(torch_version), cuda_autocast(BF16), _Ops() as ops:
            y = norm(x.clone())
    assert y.dtype == out_dtype and y.numel() * y.element_size() == 4 * 64 * (4 if out_dtype == torch.float32 else 2)
    first_cast = next(c for c in ops.calls if c[0] == "_to_copy.default")
    assert first_cast == ("_to_copy.default", torch.float32)


# ---------------------------------------------------------------------------- v2.6.0 and later releases

@pytest.mark.parametrize("torch_version, rng", [
    ("2.6", 0),          # philox_seed, philox_offset: int64 host scalars (flash_api.cpp:491-521 at v2.6.0)
    ("2.7", 2 * 8 + 8),  # rng_state uint64[2] and the unused uint64, on the device (derivatives.yaml:2877 at v2.7.0)
])
def test_flash_rng_state_is_on_the_device_from_torch_2_7(torch_version, rng):
    report, cuda = _attention_step(torch_version=torch_version)
    assert cuda.attention_backend == "flash"
    # q, k, v and the output (bf16), logsumexp fp32 [b, h, s_q], the Philox state, the bf16 loss
    assert report.saved_activation_bytes == 4 * B * H * S * D * 2 + B * H * S * 4 + rng + 2


@pytest.mark.parametrize("torch_version, d_rounded", [("2.10", 160), ("2.11", 192)])
def test_flash_rounds_a_head_dim_above_128_to_64_from_torch_2_11(torch_version, d_rounded):
    # head_size_rounded: a multiple of 32 for every head dim to 2.10 (flash_api.cpp:881 mha_bwd at
    # v2.6.0), of 64 above 128 from 2.11 (#174114): 160 stays 160, or becomes 192
    d = 160
    report, cuda = _attention_step(shape=(B, H, S, d), torch_version=torch_version)
    assert cuda.attention_backend == "flash"
    bhsd = B * H * S * d
    kept = 4 * bhsd * 2 + B * H * S * 4 + 24 + 2      # q, k, v, out, logsumexp, rng state, loss
    # backward: the loss's grad, dout and the output made contiguous, dq, dk, dv, softmax_d fp32
    # [b, h, s_q rounded to 128] and the dq accumulator fp32 [b, s_q rounded to 128, h, d rounded]
    backward = 2 + 2 * bhsd * 2 + 3 * bhsd * 2 + B * H * 128 * 4 + B * 128 * H * d_rounded * 4
    assert report.saved_activation_bytes == kept
    assert report.peak_phase == "backward" and report.peak_bytes == kept + backward


def test_cudnn_keeps_its_philox_seed_and_offset_on_the_device_without_dropout():
    # attention.cu:790-791 at v2.6.0 (and _cudnn_attention_forward in the newest source) allocate
    # both 0-dim int64 tensors on the device before `if (use_dropout)`
    report, cuda = _attention_step(dropout_p=0.0, arch="sm90", torch_version="2.13")
    assert cuda.attention_backend == "cudnn"
    # q, k, v, the output, logsumexp fp32 [b, h, s_q, 1], the seed and offset, the bf16 loss
    assert report.saved_activation_bytes == 4 * B * H * S * D * 2 + B * H * S * 4 + 2 * 8 + 2


def test_cudnn_refuses_a_query_of_length_1_to_torch_2_7_and_checks_heads_from_2_8():
    # check_cudnn_tensor_shapes refuses s_q = 1 with or without dropout (sdp_utils.cpp:406 at
    # v2.6.0) to 2.7; from 2.8, as the newest source, only with dropout
    one_query = dict(q=_t(2, 4, 1, 64), k=_t(2, 4, 8, 64), v=_t(2, 4, 8, 64))
    with pytest.raises(ValueError, match="query sequence of length 1 with torch 2.7"):
        _backend(**one_query, arch="sm90", torch_version="2.7", attention="cudnn")
    assert _backend(**one_query, arch="sm90", torch_version="2.8", attention="cudnn") == "cudnn"
    # head counts: none checked to 2.7 (sdp_utils.cpp:550-589 at v2.6.0); from 2.8
    # check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads=false>
    # (sdp_utils_cpp.h:378 at v2.8.0): with enable_gqa key and value heads each dividing the
    # query's, without all equal
    grouped = dict(q=_t(2, 4, 8, 64), k=_t(2, 2, 8, 64), v=_t(2, 1, 8, 64))
    assert _backend(**grouped, arch="sm90", torch_version="2.7", attention="cudnn") == "cudnn"
    with pytest.raises(ValueError, match="query, key and value have 4, 2, 1 heads"):
        _backend(**grouped, arch="sm90", torch_version="2.8", attention="cudnn")
    assert _backend(**grouped, enable_gqa=True, arch="sm90", torch_version="2.13") == "cudnn"


def test_efficient_attention_checks_storage_offsets_from_torch_2_13():
    # fp32 runs memory-efficient attention; a query whose storage starts 1 element in is not
    # aligned to fp32's 4 elements (minimum_gemm_alignment): 2.13 refuses it
    # (check_data_ptr_alignment_mem_efficient, #184258), 2.12 has no such check (as
    # sdp_utils.cpp:647-724 at v2.6.0), so math runs on 2.13
    def offset_query():
        return torch.randn(1 + 2 * 4 * 8 * 16)[1:].view(2, 4, 8, 16)
    fp32 = dict(q=offset_query, k=_t(2, 4, 8, 16, dtype=torch.float32), v=_t(2, 4, 8, 16, dtype=torch.float32))
    assert _backend(**fp32, torch_version="2.12") == "efficient"
    assert _backend(**fp32, torch_version="2.13") == "math"


def test_math_adds_the_mask_to_the_scores_in_place():
    # attention.cpp:864 at v2.6.0 (so in the newest source): `attn.add_(*attn_mask)`. The forward
    # allocates two fp32 [b, h, s_q, s_k] tensors of B * H * S * S * 4 bytes, the scores (matmul)
    # and the probabilities (_safe_softmax), and none for the causal mask's add
    with FakeTensorMode():
        q, k, v = _leaves((B, H, S, D), (B, H, S, D), (B, H, S, D), dtype=torch.float32)
        with cuda_semantics(attention="math"), track_memory(trace=True) as tracker:
            F.scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), is_causal=True)
    scores = [e for e in tracker.report().trace if e[0] == "alloc" and e[2] == B * H * S * S * 4]
    assert len(scores) == 2
