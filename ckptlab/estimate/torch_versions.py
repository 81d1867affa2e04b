"""The torch versions a CUDA prediction models, and what differs between them.

A prediction for CUDA (`predict(device="cuda", torch_version="2.11")`) follows the rules of one
torch release: which attention kernel SDPA tries first, which backends take grouped-query
attention, what cuBLASLt's workspace is, which ops CUDA autocast runs in fp32. The default is the
installed torch's major.minor (clamped to the versions modelled). Each rule names the PyTorch
source it follows as `path:line (function) at tag`: every file of v2.6.0 and, for the other
releases, the headers, Python and YAML their wheels ship. A `.cpp` change after 2.6 has no tag
source here; it is placed in the first release whose branch it reached (its pull request's number
and merge date, against the release's branch cut: 2.8 2025-06-25, 2.10 2025-12-10, 2.11
2026-02-18, 2.12 2026-04-15, 2.13 2026-06-08, by the releases' trackers), and docs/design.md, note
"What a fake step cannot know", lists those.

cuDNN attention's choice depends on the cuDNN the wheel ships (`versionRuntimeCuDNN()`), so each
release records the cuDNN of its default CUDA wheel (`nvidia-cudnn-cu12/cu13==` in
.github/scripts/generate_binary_build_matrix.py, PYTORCH_EXTRA_INSTALL_REQUIREMENTS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_VERSIONS = ("2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.13")

# When cuDNN attention heads SDPA's priority order (sdp_utils.cpp check_prefer_cudnn_attention,
# priority_order). The default order is ATen/Context.h's sdp_priority_order, flash, efficient, math,
# cudnn: Context.h:391 at v2.6.0 (sdp_utils.cpp:77 priority_order returns it; :58
# check_prefer_cudnn_attention is defined there but not called), :423 at v2.7.0 and v2.8.0, :440 at
# v2.9.0, :459 at v2.10.0, :467 at v2.11.0 and v2.12.0, :481 at v2.13.0. What puts cuDNN first in
# 2.9 on is in sdp_utils.cpp: no tag source, so by pull request:
#   "opt-in"   2.4: cuDNN attention runs only with TORCH_CUDNN_SDPA_ENABLED=1 (pytorch PR #128539,
#              the 2.4 cherry-pick reverting #125343); never by default.
#   "last"     2.5 - 2.8: priority_order is the constexpr {flash, efficient, math, cudnn}
#              (#138522 made cuDNN opt-in after 2.5.0's bugs), so math always comes first.
#   "compiled" 2.9: first on compute capability 9.0 / 10.0 when built with CUDNN_VERSION >= 90900
#              (#162073, "for 2.9": `(major == 9 || major == 10) && !dprops->minor`).
#   "runtime"  2.10 on: first on 9.0 / 10.0 / 10.3 when the runtime cuDNN is > 9.15.00
#              (`cudnn_version > 91500 && (major == 9 || major == 10) && (!minor || minor == 3)`,
#              "cuDNN 9.15.1 required for seq_len not divisible by 128 fix", #169849).
CUDNN_FIRST = {"2.4": "opt-in", "2.5": "last", "2.6": "last", "2.7": "last", "2.8": "last", "2.9": "compiled"}

# The default wheel's cuDNN, as versionRuntimeCuDNN() reports it (major*10000 + minor*100 + patch):
# 9.1.0.70 with the cu121 / cu124 wheels of 2.4 - 2.6, 9.5.1.17 with cu126 (2.7), 9.10.2.21 with the
# cu126 / cu128 wheels of 2.8 - 2.10 (generate_binary_build_matrix.py). 2.11: 9.19, as reported
# with torch 2.11.0+cu130 (sgl-project/sglang PR #33655; huggingface/transformers PR #48163: "What
# changes at 2.11 is the bundled cuDNN crossing the threshold"); 2.12 is taken as 2.11's; 2.13:
# 9.20.0.48 (torch 2.13.0+cu132's Requires-Dist).
WHEEL_CUDNN = {"2.4": 90100, "2.5": 90100, "2.6": 90100, "2.7": 90501, "2.8": 91002, "2.9": 91002, "2.10": 91002,
               "2.11": 91900, "2.12": 91900, "2.13": 92000}


@dataclass(frozen=True)
class TorchRules:
    """What one torch release does where the model of CUDA differs between releases."""

    version: str

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    @property
    def wheel_cudnn(self) -> int:
        return WHEEL_CUDNN[self.version]

    @property
    def has_gqa(self) -> bool:
        """scaled_dot_product_attention's `enable_gqa` exists: native_functions.yaml:14734 at v2.5.0
        (`bool enable_gqa=False`), :14677 without it at v2.4.0."""
        return self.minor >= 5

    @property
    def cudnn_attention(self) -> bool:
        """cuDNN attention is a backend SDPA may choose without an environment variable (2.5 on)."""
        return CUDNN_FIRST.get(self.version) != "opt-in"

    def cudnn_first(self, arch: str) -> bool:
        """check_prefer_cudnn_attention for a card of architecture `arch` ("sm90")."""
        major, minor = int(arch[2:-1]), int(arch[-1])
        rule = CUDNN_FIRST.get(self.version, "runtime")
        if rule == "compiled":
            return self.wheel_cudnn >= 90900 and major in (9, 10) and minor == 0
        if rule == "runtime":
            return self.wheel_cudnn > 91500 and major in (9, 10) and minor in (0, 3)
        return False

    @property
    def cudnn_dropout_in_sixteenths(self) -> bool:
        """can_use_cudnn_attention's check_cudnn_dropout: a dropout probability that is not a
        multiple of 1/16 is refused (#174245, merged 2026-02-26, after 2.11's branch cut of
        2026-02-18: from 2.12; sdp_utils.cpp, no tag source)."""
        return self.minor >= 12

    @property
    def flash_rng_on_device(self) -> bool:
        """Flash attention returns its Philox state on the device, an rng_state uint64[2] and an
        unused uint64 scalar, with or without dropout (2.7 on: derivatives.yaml:2877 names them at
        v2.7.0, torch/_meta_registrations.py:5546 "[Note] BC breaking change to flash seed/offset"
        at v2.7.0; the flash-attention submodule, #146372, merged before 2.7's branch cut of
        2025-03-12). Before: philox_seed and philox_offset (derivatives.yaml:2811 at v2.4.0, :2854
        at v2.5.0, :2876 at v2.6.0), int64 scalars on the host outside CUDA-graph capture
        (cuda/flash_attn/flash_api.cpp:491-521 mha_fwd at v2.6.0)."""
        return self.minor >= 7

    def flash_head_rounding(self, head_dim: int) -> int:
        """The multiple flash attention rounds a head dim (already a multiple of 8) up to for its
        fp32 buffers (head_size_rounded: the forward's split-key accumulators, the backward's dq
        accumulator): 32 for every head dim to 2.10 (cuda/flash_attn/flash_api.cpp:444 mha_fwd,
        :881 mha_bwd at v2.6.0); from 2.11, 64 above 128 (#174114, merged 2026-02-03, before 2.11's
        branch cut of 2026-02-18: "still rounds the kernels by multiples of 32" before it;
        flash_api.cpp, no tag source)."""
        return 64 if self.minor >= 11 and head_dim > 128 else 32

    @property
    def cudnn_checks_heads(self) -> bool:
        """can_use_cudnn_attention checks head counts, check_batch_size_and_num_heads_dense<
        supports_gqa, requires_same_num_heads=false> (2.8 on: requires_same_num_heads, which only
        cuDNN turns off, at sdp_utils_cpp.h:378 at v2.8.0, :398 at v2.13.0, absent at v2.7.0, :376;
        #149976 merged 2025-03-29 and #150337, after 2.7's branch cut of 2025-03-12). Before: no
        head check (cuda/sdp_utils.cpp:550-589 can_use_cudnn_attention at v2.6.0)."""
        return self.minor >= 8

    @property
    def cudnn_refuses_any_query_length_1(self) -> bool:
        """check_cudnn_tensor_shapes refuses s_q = 1 with or without dropout (cuda/sdp_utils.cpp:406
        at v2.6.0, `s_q == 1 || s_k == 1`), to 2.7: #150318, which was to allow it, was opened after
        2.7's branch cut and deferred on 2025-04-29. From 2.8, the newest source's rule: s_q = 1 only
        with dropout (the release that relaxed it is not known; sdp_utils.cpp, no tag source)."""
        return self.minor <= 7

    @property
    def efficient_checks_storage_offsets(self) -> bool:
        """can_use_mem_efficient_attention refuses q, k, v whose storage offsets are not multiples
        of the kernel's alignment (check_data_ptr_alignment_mem_efficient: #184258, merged
        2026-05-18, before 2.13's branch cut of 2026-06-08; sdp_utils.cpp, no tag source). Absent
        before (cuda/sdp_utils.cpp:647-724 at v2.6.0)."""
        return self.minor >= 13

    @property
    def cublaslt_workspace(self) -> str:
        """Where an addmm with a bias vector (cuBLASLt) gets its workspace:
        "per-call"   2.4 - 2.8: CUDABlas.cpp:1213 (gemm_and_bias) allocates _getWorkspaceSize(),
                     1 MiB (:194, CUBLASLT_WORKSPACE_SIZE's default, #73328), per call (:1277,
                     :1291) at v2.6.0, through the caching allocator, and frees it after the call;
        "persistent" 2.9, 2.10: CublasHandlePool.cpp getCUDABlasLtWorkspace keeps 1 MiB per
                     (handle, stream), for the life of the process (#156495, merged 2025-06-27;
                     declared at CUDAContextLight.h:95 at v2.9.0, absent at v2.8.0);
        "unified"    2.11 on: unified_cublas_and_lt_workspaces() is on by default (#168175, merged
                     2026-01; no tag source): cuBLASLt uses the thread's cuBLAS workspace,
                     allocating nothing more."""
        return "per-call" if self.minor <= 8 else "persistent" if self.minor <= 10 else "unified"

    @property
    def autocast_fp32_rms_norm(self) -> bool:
        """CUDA autocast's fp32 list has rms_norm from 2.12: autocast_mode.h:876 (AT_FORALL_FP32)
        at v2.12.0 and v2.13.0, absent from its list (:855) at v2.11.0 (pytorch PR #174824)."""
        return self.minor >= 12


def installed_torch_version() -> str:
    """The running torch's major.minor ("2.13")."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def default_torch_version() -> str:
    """The installed torch's major.minor, or the nearest version modelled."""
    installed = installed_torch_version()
    if installed in TORCH_VERSIONS:
        return installed
    newer = tuple(int(p) for p in installed.split(".")) > (2, int(TORCH_VERSIONS[-1].split(".")[1]))
    return TORCH_VERSIONS[-1] if newer else TORCH_VERSIONS[0]


def check_torch_version(torch_version) -> None:
    """ValueError naming the value and the versions modelled, unless `torch_version` is one of them
    (None: the default)."""
    if torch_version is not None and torch_version not in TORCH_VERSIONS:
        raise ValueError(f"torch_version={torch_version!r} is invalid: allowed are {', '.join(TORCH_VERSIONS)} "
                         f"(default: the installed torch's, {default_torch_version()})")


def torch_rules(torch_version: str | None = None) -> TorchRules:
    """The rules of `torch_version` (default: `default_torch_version()`); ValueError for a version
    not modelled."""
    check_torch_version(torch_version)
    return TorchRules(torch_version or default_torch_version())


__all__ = ["TORCH_VERSIONS", "TorchRules", "check_torch_version", "default_torch_version", "installed_torch_version",
           "torch_rules"]
