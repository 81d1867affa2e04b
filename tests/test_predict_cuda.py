"""Predictions for a CUDA card from this CPU-only machine: the optimizer's implementation, the
allocator's numbers, the card's device bytes and margin, and the command line that prints them."""

import concurrent.futures
import dataclasses
import json
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptlab
from ckptlab.apps.cli import main as cli_main
from ckptlab.core import workers as workers_module
from ckptlab.core.cards import CUBLAS_WORKSPACE_BYTES, card, parse_capacity
from ckptlab.core.policy import parse_policy
from ckptlab.core.units import format_bytes
from ckptlab.estimate import predict as predict_module
from ckptlab.estimate.cuda_device import CUBLASLT_WORKSPACE_BYTES, BlasUse
from ckptlab.estimate.fake_step import DEVICE_CATEGORIES, fake_memory
from ckptlab.estimate.torch_versions import torch_rules
from ckptlab.probe.memory import track_memory

TINY = dict(n_layer=2)


@pytest.fixture(scope="module")
def tiny():
    return ckptlab.get_workload("gpt-tiny", **TINY)


def optimizer_step_growth(workload, optimizer: str, device: str = "cuda") -> tuple[int, int]:
    """(the most the optimizer step holds above a level it went down to before: its temporaries,
    trainable bytes)."""
    fake = fake_memory(workload, 1, 8, parse_policy("none"), "fp32", optimizer, device=device)
    timeline = fake.report.timeline
    start = next(i for i, (phase, _) in enumerate(timeline) if phase == "optimizer")
    rise, low = 0, timeline[start - 1][1]
    for _, total in timeline[start:]:
        low = min(low, total)
        rise = max(rise, total - low)
    return rise, fake.report.param_bytes["trainable_param_bytes"]


def test_adamw_on_cuda_is_foreach_whose_temporary_is_one_state_at_the_optimizer_step(tiny):
    # _multi_tensor_adam: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) (torch/optim/adam.py:762
    # at v2.13.0), a list as large as one state (4 B per trainable fp32 parameter), alive while the
    # update runs.
    growth, trainable = optimizer_step_growth(tiny, "adamw")
    assert growth == trainable == optimizer_step_growth(tiny, "adamw-foreach")[0]
    p = ckptlab.predict(tiny, 1, 8, "full", loop="adamw", device="cuda")
    assert p.peak_phase == "optimizer" and p.peak_by_category["temporaries"] >= trainable


def test_adamw_fused_has_no_temporaries_and_the_for_loop_two_of_the_largest_parameter(tiny):
    assert optimizer_step_growth(tiny, "adamw-fused")[0] == 0
    largest = max(p.numel() * p.element_size() for p in tiny.build("meta").parameters())
    # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt), one parameter at a
    # time; the previous parameter's denom lives until the name is rebound
    forloop, trainable = optimizer_step_growth(tiny, "adamw-forloop")
    assert 2 * largest <= forloop < 3 * largest < trainable
    assert optimizer_step_growth(tiny, "adamw", device="cpu")[0] == forloop   # torch's pick on CPU


def test_cuda_prediction_adds_up_allocated_reserved_device_and_margin(tiny):
    rtx = card("rtx4090")
    p = ckptlab.predict(tiny, 2, 32, "none", dtype="bf16", device="cuda", card="rtx4090")
    by = p.peak_by_category
    assert p.device == "cuda" and p.card == "rtx4090" and p.attention_backend == "flash"
    assert by["fragmentation"] == p.reserved_bytes - p.peak_bytes >= 0
    assert sum(v for c, v in by.items() if c != "fragmentation") == p.peak_bytes
    assert p.device_bytes == p.reserved_bytes + rtx.context_bytes
    assert p.margin_bytes == rtx.usable_bytes - rtx.required_margin_bytes - p.device_bytes
    record = p.record()
    assert record["predicted_reserved_bytes"] == p.reserved_bytes and record["margin_bytes"] == p.margin_bytes
    assert record["predicted_peak_fragmentation_bytes"] == by["fragmentation"]


@pytest.mark.parametrize("torch_version, lt_kept", [("2.8", 0), ("2.10", 1), ("2.13", 0)])
def test_cublas_and_cublaslt_workspaces_per_torch_version(tiny, torch_version, lt_kept):
    # Forward multiplies on the caller's thread, backward on autograd's: a cuBLAS workspace each
    # (8 MiB + 128 KiB below sm90, 32 MiB on sm90). gpt-tiny's Linear layers have biases (addmm:
    # cuBLASLt), run in forward, and in backward only when checkpointing recomputes them there.
    # cuBLASLt's 1 MiB: per call in 2.8 (allocated and freed around the matmul: nothing kept), per
    # thread in 2.10 (kept), the thread's cuBLAS workspace itself in 2.13 (unified: nothing more).
    none = ckptlab.predict(tiny, 2, 32, "none", dtype="bf16", device="cuda", card="rtx4090", torch_version=torch_version)
    assert none.peak_by_category["workspaces"] == 2 * CUBLAS_WORKSPACE_BYTES[8] + lt_kept * CUBLASLT_WORKSPACE_BYTES
    full = ckptlab.predict(tiny, 2, 32, "full", dtype="bf16", device="cuda", card="h100-80", torch_version=torch_version)
    assert full.peak_by_category["workspaces"] == 2 * (CUBLAS_WORKSPACE_BYTES[9] + lt_kept * CUBLASLT_WORKSPACE_BYTES)
    assert none.torch_version == torch_version == none.record()["torch_version"]


def test_cublaslt_workspace_per_call_before_torch_2_9_is_a_transient_of_the_matmul():
    # CUDABlas.cpp:1291 (gemm_and_bias, at v2.6.0; 2.4 - 2.8) allocates its 1 MiB workspace (:194)
    # for the call: the peak of
    # one Linear with bias is its output plus 1 MiB; from 2.9 the workspace is kept apart.
    def peak(torch_version):
        with FakeTensorMode():
            lin, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
            with track_memory() as tracker, BlasUse(torch_rules(torch_version)) as blas:
                lin(x)
        return tracker.report().peak_bytes, blas.workspaces("sm80")
    (per_call, kept_28), (apart, kept_210) = peak("2.8"), peak("2.10")
    assert per_call - apart == CUBLASLT_WORKSPACE_BYTES
    assert kept_28 == [CUBLAS_WORKSPACE_BYTES[8]] and kept_210 == [CUBLAS_WORKSPACE_BYTES[8], CUBLASLT_WORKSPACE_BYTES]


def test_cpu_prediction_has_no_cuda_numbers(tiny):
    p = ckptlab.predict(tiny, 2, 32, "none")
    assert (p.device, p.card, p.reserved_bytes, p.device_bytes, p.margin_bytes, p.attention_backend) == (
        "cpu", None, None, None, None, None)
    assert sum(p.peak_by_category.values()) == p.peak_bytes and not set(DEVICE_CATEGORIES) & set(p.peak_by_category)
    record = p.record()
    assert record["predicted_device_bytes"] is None and record["predicted_peak_fragmentation_bytes"] is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="tpu"), "device='tpu' is invalid: allowed are cpu, cuda"),
    (dict(device="cuda", card="rtx5090"), "card='rtx5090' is invalid: allowed are rtx3090"),
    (dict(device="cpu", card="rtx4090"), "card='rtx4090' is invalid with device='cpu'"),
    (dict(card="rtx4080"), "card='rtx4080' is invalid: allowed are rtx3090"),   # a card alone means CUDA
    (dict(device="cuda", attention="fast"), "attention='fast' is invalid: allowed are flash, efficient, math, cudnn"),
    (dict(loop="adamw-turbo"), "optimizer='adamw-turbo' is invalid: allowed are adamw, adamw-foreach"),
    (dict(device="cuda", torch_version="2.3"), r"torch_version='2.3' is invalid: allowed are 2.4, 2.5, .*2.13"),
    (dict(torch_version="2.11"), "torch_version='2.11' is invalid with device='cpu'"),
    (dict(device="cuda", attention="cudnn", torch_version="2.4"), "attention='cudnn' is invalid with torch_version='2.4'"),
])
def test_bad_device_card_attention_or_optimizer_is_one_line_before_work(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ckptlab.predict(tiny, 1, 8, "none", **kwargs)
    assert "\n" not in str(info.value)


def test_a_card_without_a_device_is_predicted_for_cuda(tiny):
    alone = ckptlab.predict(tiny, 1, 8, "full", card="rtx4090")
    said = ckptlab.predict(tiny, 1, 8, "full", device="cuda", card="rtx4090")
    assert dataclasses.replace(alone, predict_s=0) == dataclasses.replace(said, predict_s=0) and alone.device == "cuda"
    assert ckptlab.predict(tiny, 1, 8, "full").device == "cpu"


def test_cli_predict_for_a_card_prints_allocated_reserved_device_backend_and_margin(capsys):
    args = ["predict", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "1", "--seq", "16", "--policy", "full",
            "--device", "cuda", "--card", "rtx4090", "--attention", "math"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "predicted for RTX 4090" in text
    for column in ("allocated (rtx4090)", "reserved (rtx4090)", "device (rtx4090)", "margin left (rtx4090)", "attention"):
        assert column in text
    assert cli_main(args + ["--format", "json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["attention_backend"] == "math" and row["card"] == "rtx4090"
    assert row["margin_bytes"] == card("rtx4090").usable_bytes - card("rtx4090").required_margin_bytes - row["predicted_device_bytes"]
    assert cli_main(["predict", "--model", "gpt-tiny", "--card", "rtx5090"]) == 2
    assert capsys.readouterr().err.startswith("error: --card rtx5090 is invalid")
    assert cli_main(args[:-2] + ["--torch-version", "2.11", "--format", "json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["torch_version"] == "2.11"
    for bad in (["--torch-version", "3.0"], ["--attention", "cudnn", "--torch-version", "2.4"]):
        assert cli_main(["predict", "--model", "gpt-tiny", "--card", "h200", *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_cli_predict_for_several_cards_gives_each_the_rows_of_its_own_command(capsys):
    """A table per card (json: one list), each card's rows those of a command for that card alone;
    an A100's steps are the RTX 4090's traced ones (the same kernel choices); a bad card in the
    list is one line, exit 2."""
    args = ["predict", "--model", "gpt-tiny", "--set", "n_layer=8", "--batch", "2", "--seq", "32", "--policy", "none,full"]
    assert cli_main([*args, "--card", "rtx4090,a100-40,rtx4090", "--format", "json"]) == 0
    together = json.loads(capsys.readouterr().out)
    alone = []
    for name in ("rtx4090", "a100-40"):
        assert cli_main([*args, "--card", name, "--format", "json"]) == 0
        alone += json.loads(capsys.readouterr().out)
    assert [r["card"] for r in together] == ["rtx4090", "rtx4090", "a100-40", "a100-40"]
    assert [r["trace"] for r in together[2:]] == ["composed, from the step traced for rtx4090 (the same kernels)"] * 2

    def same(r):
        return {k: v for k, v in r.items() if k not in ("predict_s", "trace")}

    assert [same(r) for r in together] == [same(r) for r in alone]
    assert cli_main([*args, "--card", "rtx4090,a100-40"]) == 0
    out = capsys.readouterr().out
    assert out.count("nothing allocated") == 2 and "margin left (rtx4090)" in out and "margin left (a100-40)" in out
    for bad, says in ((["--card", "rtx4090,rtx5090"], "--card rtx5090 is invalid"),
                      (["--card", ","], "--card ',' is invalid"),
                      (["--card", "rtx4090,,h200"], "--card 'rtx4090,,h200' is invalid"),
                      (["--card", ""], "--card '' is invalid"),
                      (["--device", "cpu", "--card", "rtx4090"], "--card rtx4090 is invalid with --device cpu"),
                      (["--device", "gpu", "--card", "rtx4090"], "--device gpu is invalid")):
        assert cli_main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and err.count("\n") == 1


def test_predict_fits_on_a_card_leaves_the_margin_predict_says(tiny):
    row, = ckptlab.predict_fits(tiny, ["full"], capacities=["rtx4090"], seq_len=16, batch_size=1, dtype="fp32",
                                max_batch=2, seq_lens=[16], torch_version="2.10")
    p = ckptlab.predict(tiny, 2, 16, "full", dtype="fp32", device="cuda", card="rtx4090", torch_version="2.10")
    assert row["max_batch_size"] == 2 and row["batch_margin_bytes"] == p.margin_bytes
    assert row["torch_version"] == "2.10"
    assert row["basis"] == "predicted for RTX 4090" and row["device"] == "cuda"


def test_predict_fits_in_worker_processes_answers_the_same_rows(tiny):
    """Two tasks (a policy on cards of two architectures) in two spawned processes, rows in order."""
    options = dict(capacities=["a100-40", "rtx4090"], seq_len=16, batch_size=1, dtype="fp32", max_batch=4, seq_lens=[16])
    here = ckptlab.predict_fits(tiny, ["full"], **options)
    assert ckptlab.predict_fits(tiny, ["full"], **options, workers=2) == here
    assert [r["capacity"] for r in here] == ["a100-40", "rtx4090"]
    with pytest.raises(ValueError, match="workers=0 is invalid"):
        ckptlab.predict_fits(tiny, ["full"], **options, workers=0)


def test_worker_processes_take_the_longest_tasks_first_and_this_process_the_shortest(tiny, monkeypatch):
    """The policies that recompute more blocks first (their batch searches step further), then
    the cards of more memory, to the spawned worker; this process takes them from the other end;
    the rows in the order asked."""
    spawned, here, fit_rows, one_at_a_time = [], [], predict_module._fit_rows, threading.Lock()

    class InThreads:   # a pool that runs its tasks in the caller's thread, recording them
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, task):
            future = concurrent.futures.Future()
            if fn is workers_module._ready:
                time.sleep(0.05)   # a spawned worker's start: this process takes a task meanwhile
                future.set_result(None)
                return future
            spawned.append((str(task[1]), [c.name for c in task[2]]))
            future.set_result(fn(task))
            return future

        def shutdown(self, **kwargs):
            pass

    def recorded(workload, policy, caps, **options):
        if threading.current_thread() is threading.main_thread():
            here.append((str(policy), [c.name for c in caps]))
        with one_at_a_time:   # ckptlab's prepared steps are one process's, used by one thread at a time
            return fit_rows(workload, policy, caps, **options)

    monkeypatch.setattr(workers_module, "ProcessPoolExecutor", InThreads)
    monkeypatch.setattr(predict_module, "_fit_rows", recorded)
    options = dict(capacities=["rtx4090", "h200"], seq_len=16, batch_size=1, dtype="fp32", max_batch=2, seq_lens=[16])
    policies = ["none", "density=0.5", "full"]
    done = []   # a progress bar's updates: the rows of each task as it finishes, in either process
    rows = ckptlab.predict_fits(tiny, policies, **options, workers=2, progress=done.append)
    longest_first = [(p, [c]) for p in ("full", "density=0.5", "none") for c in ("h200", "rtx4090")]
    assert spawned and here and spawned + here[::-1] == longest_first
    assert done == [1] * 6
    assert rows == ckptlab.predict_fits(tiny, policies, **options)


def test_a_budget_plan_on_cuda_fits_the_cuda_allocated_peak(tiny):
    none = ckptlab.predict(tiny, 4, 128, "none", device="cuda")
    full = ckptlab.predict(tiny, 4, 128, "full", device="cuda")
    budget = (none.peak_bytes + full.peak_bytes) // 2
    p = ckptlab.predict(tiny, 4, 128, f"budget={budget}B", device="cuda")
    assert p.peak_bytes <= budget < none.peak_bytes and p.plan


def test_offload_on_cuda_moves_what_the_blocks_save_to_pinned_host_memory(tiny):
    kept = ckptlab.predict(tiny, 2, 32, "none", device="cuda")
    offloaded = ckptlab.predict(tiny, 2, 32, "none+offload", device="cuda")
    assert offloaded.host_bytes > 0 and kept.host_bytes is None and not offloaded.note
    # what leaves the device is what the blocks saved; what stays is saved outside them
    assert offloaded.saved_activation_bytes < kept.saved_activation_bytes
    assert offloaded.saved_activation_bytes + offloaded.host_bytes >= kept.saved_activation_bytes
    on_cpu = ckptlab.predict(tiny, 2, 32, "none+offload")
    assert on_cpu.host_bytes is None and "no-op on CPU" in on_cpu.note


def test_a_llama_in_bf16_runs_cudnn_attention_on_hopper_where_its_torch_prefers_it():
    # hf-llama-tiny without attention dropout (Llama's default): grouped-query attention, head
    # dim 8, bf16. sm90 cards put cuDNN first in 2.9 and from 2.11 (torch_versions.CUDNN_FIRST);
    # sm80 and sm89 cards keep flash first.
    llama = ckptlab.get_workload("hf-llama-tiny", attention_dropout=0.0)
    for card_name, torch_version, backend in (("h100-80", "2.13", "cudnn"), ("h200", "2.11", "cudnn"),
                                              ("h200", "2.10", "flash"), ("rtx4090", "2.13", "flash"),
                                              ("a100-80", "2.13", "flash")):
        p = ckptlab.predict(llama, 1, 16, "none", dtype="bf16", device="cuda", card=card_name,
                            torch_version=torch_version)
        assert (p.attention_backend, p.torch_version) == (backend, torch_version), card_name
        assert p.record()["attention_backend"] == backend


class PaddedEncoder(nn.Module):
    """Two encoder blocks whose attention takes a [b, 1, 1, s] bool padding mask."""

    def __init__(self, width=32, heads=2, vocab=64):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(qkv=nn.Linear(width, 3 * width), out=nn.Linear(width, width)))
                                    for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, mask):
        h = self.embed(ids)
        b, s, w = h.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](h).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
            h = h + layer["out"](a.transpose(1, 2).reshape(b, s, w))
        return self.head(h)


def padded_encoder():
    def batch(b, s, gen):
        return torch.randint(0, 64, (b, s), generator=gen), torch.ones(b, s, dtype=torch.bool)

    return ckptlab.Workload.custom("padded-encoder", PaddedEncoder, batch,
                                   lambda model, batch: model(*batch).float().logsumexp(-1).mean(), blocks="layers")


def test_a_masked_encoder_at_500_keys_is_predicted_no_higher_than_at_512():
    # fp32 with a mask: memory-efficient attention. preprocess_mask (attention.cpp:574-589 at v2.6.0)
    # pads the [b, 1, 1, 500] mask to 504 and expands a view: nothing of [b, h, s_q, s_k] is
    # materialised, so 500 keys hold less than 512. (Expanding first, then padding, kept a [b, h, 500,
    # 504] fp32 copy per block: 2 * 2 * 500 * 504 * 4 B = 4 MB, more than the step's activations at
    # 512.)
    encoder = padded_encoder()
    at = {s: ckptlab.predict(encoder, 2, s, "none", device="cuda", card="a100-80") for s in (500, 512)}
    assert {p.attention_backend for p in at.values()} == {"efficient"}
    assert at[500].peak_bytes <= at[512].peak_bytes


def test_a_reserved_peak_past_the_card_is_answered_by_the_allocators_flush_and_retry(tiny):
    # A card whose usable bytes are the device bytes + the margin - 1: the reserved peak passes what
    # the allocator may reserve by one byte (margin_left = usable - margin - device = -1), so the
    # answer is not "yes"; the replay under that limit releases the wholly free segments and
    # retries (c10/cuda/CUDACachingAllocator.cpp:1234-1242, malloc -> release_cached_blocks ->
    # alloc_block, at v2.6.0). Whether
    # the retry finds room depends on the layout (a wholly free segment at the limit): it does for
    # this step, whose free cache at that moment holds one.
    p = ckptlab.predict(tiny, 8, 128, "none", dtype="bf16", device="cuda", card="rtx4090")
    assert p.fit == "yes" and p.cache_flushes is None and p.margin_bytes >= 0
    margin = card("rtx4090").required_margin_bytes
    tight = parse_capacity("rtx4090", usable_bytes=p.device_bytes + margin - 1)
    q = ckptlab.predict(tiny, 8, 128, "none", dtype="bf16", device="cuda", card=tight)
    assert (q.reserved_bytes, q.peak_bytes, q.margin_bytes) == (p.reserved_bytes, p.peak_bytes, -1)
    assert q.fit == "with cache flushes" and q.cache_flushes >= 1
    assert "fits with cache flushes" in q.fit_reason and "exceeds the card less its margin by 1 B" in q.fit_reason
    # A limit under the allocated peak: no release of cached blocks makes room (allocated <= reserved
    # at every moment), so "no".
    context = p.device_bytes - p.reserved_bytes
    short = parse_capacity("rtx4090", usable_bytes=p.peak_bytes + context + margin - 1)
    never = ckptlab.predict(tiny, 8, 128, "none", dtype="bf16", device="cuda", card=short)
    assert never.fit == "no" and never.cache_flushes is None   # a step that never runs has no flushes per step


def test_cli_predict_says_how_far_a_row_passes_the_card_less_its_margin(capsys):
    # gpt-tiny in bf16 on an L4: batch 3200 fits; at 3250 the reserved peak passes the card less its
    # margin and the allocator's flush and retry runs the step; at 3450 nothing does.
    args = ["predict", "--model", "gpt-tiny", "--card", "l4", "--batch", "3200,3250,3450", "--seq", "256",
            "--policy", "none", "--dtype", "bf16", "--torch-version", "2.13"]
    assert cli_main(args + ["--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["fit"] for r in rows] == ["yes", "with cache flushes", "no"]
    assert [r["margin_bytes"] < 0 for r in rows] == [False, True, True]   # the records keep margin left as it is
    assert cli_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert " yes " in lines[3] and "over by" not in lines[3]
    assert f"with cache flushes (over by {format_bytes(-rows[1]['margin_bytes'])})" in lines[4]
    assert f"no (over by {format_bytes(-rows[2]['margin_bytes'])})" in lines[5]
    l4 = card("l4")
    assert lines[6].startswith(f"margin left: the L4's {format_bytes(l4.usable_bytes)} usable less its "
                               f"{format_bytes(l4.required_margin_bytes)} margin less the device bytes; a row over by")


def test_expandable_segments_are_an_allocator_option_of_the_prediction(tiny, capsys):
    default = ckptlab.predict(tiny, 8, 256, "none", device="cuda", card="rtx4090")
    expandable = ckptlab.predict(tiny, 8, 256, "none", device="cuda", card="rtx4090",
                                 alloc_conf="expandable_segments:True")
    assert expandable.alloc_conf == "expandable_segments:True" and default.alloc_conf is None
    # Pages of 2 MiB (small pool) and 20 MiB (large pool) are mapped as needed: reserved is whole
    # pages. should_split keeps any rest of 512 B or more with expandable segments, where the
    # default large pool hands out a whole block whose rest is 1 MiB or less: less is allocated.
    assert expandable.reserved_bytes % (2 * 2**20) == 0 and expandable.peak_bytes < default.peak_bytes
    assert ckptlab.predict(tiny, 8, 256, "none", device="cuda",
                           alloc_conf="expandable_segments:False").peak_bytes == default.peak_bytes
    with pytest.raises(ValueError, match=r"alloc_conf='max_split_size_mb:128' is invalid: allowed are expandable"):
        ckptlab.predict(tiny, 2, 32, "none", device="cuda", alloc_conf="max_split_size_mb:128")
    assert cli_main(["predict", "--model", "gpt-tiny", "--card", "rtx4090", "--alloc-conf", "expandable:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --alloc-conf expandable:1 is invalid") and err.count("\n") == 1


def test_the_first_step_creates_the_optimizer_state_where_its_optimizer_phase_begins(tiny):
    # AdamW (foreach on CUDA) creates per trainable parameter `step` (a 0-dim fp32 tensor: 4 B),
    # `exp_avg` and `exp_avg_sq` (each the parameter's bytes) at the first step() (torch/optim/
    # adam.py:162-182, _init_group, which AdamW inherits, at v2.13.0). So the state the tracked step
    # starts with is 2 x trainable bytes + 4 B each.
    from ckptlab.estimate import fake_step
    seen = {}
    replay = fake_step.device_memory

    def spy(trace, *args, loop_order=None, **kwargs):
        seen.update(trace=trace, order=loop_order)
        return replay(trace, *args, loop_order=loop_order, **kwargs)

    fake_step.device_memory = spy
    try:
        fake = fake_memory(tiny, 2, 32, parse_policy("none"), "fp32", device="cuda")
    finally:
        fake_step.device_memory = replay
    trace, order = seen["trace"], seen["order"]
    trainable = [p for p in tiny.build("meta").parameters() if p.requires_grad]
    state_sizes = sorted(size for _, key, size in trace if key in order.state_keys)
    assert sum(state_sizes) == 2 * fake.report.param_bytes["trainable_param_bytes"] + 4 * len(trainable)
    assert state_sizes.count(4) == len(trainable)
    # the optimizer phase begins after the backward: every gradient is allocated before it
    assert trace[order.optimizer_at][0] in ("alloc", "free") and order.optimizer_at > len(trace) // 2
    assert fake.device.worse_step in (1, 2)


def test_pinned_host_memory_is_held_in_powers_of_two_per_size():
    # CachingHostAllocator.h:302-309 (allocate: roundSize = PowerOf2Ceil(size)) at v2.13.0; a freed
    # block (:312 get_free_block) serves only a
    # later request of the same rounded size. 3000 B -> 4096 B, 5000 B -> 8192 B; the first is
    # dropped and 3000 B more packed: its 4096 B block is reused. Held: 4096 + 8192 = 12,288 B
    # (the raw bytes peak at 8,000 B).
    import torch

    from ckptlab.estimate.cuda_device import HostOffload
    host = HostOffload()
    first = host._pack(torch.empty(750, dtype=torch.float32, device="meta"))     # 3000 B
    second = host._pack(torch.empty(1250, dtype=torch.float32, device="meta"))   # 5000 B
    del first
    third = host._pack(torch.empty(750, dtype=torch.float32, device="meta"))
    assert host.peak_bytes == 4096 + 8192 and second and third


def test_predict_fits_says_how_far_cache_flushes_reach(tiny):
    # The card of the flush test above: batch 8 passes it by one byte of device bytes, so the
    # largest batch that fits is below 8, and 8 itself runs with cache flushes.
    p = ckptlab.predict(tiny, 8, 128, "none", dtype="bf16", device="cuda", card="rtx4090")
    tight = parse_capacity("rtx4090", usable_bytes=p.device_bytes + card("rtx4090").required_margin_bytes - 1)
    row, = ckptlab.predict_fits(tiny, ["none"], capacities=[tight], seq_len=128, batch_size=8, dtype="bf16",
                                max_batch=8, seq_lens=[128])
    assert row["max_batch_size"] < 8 == row["max_batch_size_with_flushes"]
    assert row["max_seq_len"] == 0 and row["max_seq_len_with_flushes"] == 128


@pytest.mark.parametrize("model, attention, on_card, dtype", [
    (("gpt-tiny", TINY), "flash", "rtx4090", "bf16"), (("gpt-tiny", TINY), "efficient", "a100-40", "fp32"),
    (("hf-llama-tiny", dict(num_hidden_layers=2, attention_dropout=0.0)), "cudnn", "h100-80", "bf16")])   # cuDNN: no dropout
def test_the_warm_up_sees_past_the_attention_kernels_and_leaves_what_a_backward_would(monkeypatch, model, attention,
                                                                                      on_card, dtype):
    """The warm-up finds the parameters a step trains from its forward's graph, through the attention
    kernels' autograd Functions (their backward reaches only their inputs), without a backward:
    the prediction is the one a warm-up running the backward gives."""
    from ckptlab.estimate import fake_step
    backwards = []
    run_backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: backwards.append(1) or run_backward(self, *a, **k))
    options = dict(dtype=dtype, device="cuda", card=on_card, attention=attention)
    tiny = ckptlab.get_workload(model[0], **model[1])
    walked = ckptlab.predict(tiny, 2, 64, "none", **options)
    assert walked.attention_backend == attention and len(backwards) == 1   # the tracked step's own
    fake_step.clear_prepared()
    monkeypatch.setattr(fake_step, "KERNEL_FUNCTIONS", ())
    ran = ckptlab.predict(tiny, 2, 64, "none", **options)
    assert len(backwards) == 3   # the warm-up's and the tracked step's
    assert {**dataclasses.asdict(walked), "predict_s": 0} == {**dataclasses.asdict(ran), "predict_s": 0}


class _TwiceBlock(nn.Module):
    """A block that applies its one Linear twice: under autocast, the second use takes the
    weight's cast from autocast's cache."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h):
        a = self.lin(h)
        return h + self.lin(F.silu(a)) * a.detach().sigmoid()


class _TwiceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(_TwiceBlock() for _ in range(6))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def test_a_step_that_selective_checkpointing_refuses_under_autocast_is_a_clear_error():
    twice = ckptlab.Workload.custom(
        "twice", build_model=_TwiceNet, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        make_batch=lambda b, s, g: (torch.randn(b, s, 8, generator=g), torch.randint(0, 3, (b,), generator=g)))
    with pytest.raises(ValueError, match=r"policy=selective with dtype='bf16' cannot be predicted for model='twice' on "
                                         r"cuda: its step fails in torch's selective checkpointing: aten._to_copy"):
        ckptlab.predict(twice, 2, 16, "selective", dtype="bf16", device="cuda", card="rtx4090")
    plan = ckptlab.plan_budget(twice, 2, 16, 1.0, dtype="bf16", card="rtx4090")   # planned without selective
    assert "s" not in plan.letters and "aten._to_copy" in plan.refused["selective"]
    for policy, dtype in (("full", "bf16"), ("selective", "bf16-weights")):   # the ways around it step
        assert ckptlab.predict(twice, 2, 16, policy, dtype=dtype, device="cuda", card="rtx4090").peak_bytes > 0


def test_a_mask_of_ones_a_model_makes_itself_is_skipped_as_in_a_real_step():
    """BART's decoder makes a padding mask of ones where it is given none; transformers then lets
    SDPA apply causality (flash on a GPU) where it can read the mask. A fake step cannot read it,
    and built a (batch, 1, seq, seq) mask the real step never builds: 512 B saved more than the
    CPU measurement, and on CUDA the decoder's attention on math instead of flash."""
    bart = ckptlab.get_workload("hf:bart", encoder_layers=2, decoder_layers=2)
    measured = ckptlab.measure(bart, 2, 16, "full", steps=1, warmup=1, max_seconds=0.1)
    predicted = ckptlab.predict(bart, 2, 16, "full")
    assert (predicted.peak_bytes, predicted.saved_activation_bytes) == (measured["peak_bytes"],
                                                                         measured["saved_activation_bytes"])
    assert ckptlab.predict(bart, 2, 16, "none", dtype="bf16", device="cuda", card="rtx4090").attention_backend == "flash"


def test_a_parameter_that_autograd_gives_no_gradient_is_predicted_without_one():
    """Swin's relative-position bias tables get an undefined gradient under selective
    checkpointing with bf16 weights on CUDA: their post-accumulate hooks run with no gradient."""
    swin = ckptlab.get_workload("hf:swin", depths=[1, 1, 9, 1], num_heads=[1, 1, 2, 2])
    fast, full = (ckptlab.predict(swin, 2, 32, "selective", dtype="bf16-weights", device="cuda", card="h100-80",
                                  trace=trace) for trace in ("fast", "full"))
    assert fast.peak_bytes == full.peak_bytes > 0 and fast.peak_by_category == full.peak_by_category


class _InPlaceActivations(nn.Module):
    """Blocks whose ReLU works in place on a Linear's output, which selective checkpointing keeps."""

    def __init__(self, depth: int = 4, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.ReLU(inplace=True),
                                                  nn.Linear(2 * width, width)) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_step_whose_in_place_activation_selective_checkpointing_refuses_is_a_clear_error():
    in_place = ckptlab.Workload.custom(
        "in-place", build_model=_InPlaceActivations, loss=lambda m, b: m(b[0]).square().mean(),
        make_batch=lambda b, s, g: (torch.randn(b, s, 16, generator=g),))
    with pytest.raises(ValueError, match=r"is changed in place later in the block \(an in-place activation"):
        ckptlab.predict(in_place, 2, 8, "selective")
    # the planner plans it with keep and full, and says why no block is selective
    none, full = (ckptlab.predict(in_place, 4, 64, policy).peak_bytes for policy in ("none", "full"))
    plan = ckptlab.plan_budget(in_place, 4, 64, (none + full) // 2)
    assert set(plan.letters) == {"k", "f"} and "in-place activation" in plan.refused["selective"]
    assert "no block selective: the step fails in torch's selective checkpointing" in str(plan)
    record = ckptlab.measure(in_place, 4, 64, f"budget={(none + full) // 2}B", steps=1, warmup=0)
    assert record["status"] == "ok" and record["plan"] == plan.letters and record["peak_bytes"] <= plan.budget_bytes
