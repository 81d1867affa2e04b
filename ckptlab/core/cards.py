"""The GPUs ckptlab answers for, by what they offer: the bytes `torch.cuda.get_device_properties()
.total_memory` reports, what the CUDA context takes outside the caching allocator, and the
compute capability (which attention kernels run).

A card is named wherever a capacity is asked for (`capacity="rtx4090"`, `--capacity h100-80`,
`predict_fits(capacities=["rtx4090", "24GiB"])`); `parse_capacity` is the one parser. A plain
size is a capacity too: the bytes a step may use, with no context and no margin, as an emulated
limit on a CPU is. Either can be adjusted: `parse_capacity("rtx4090", usable_bytes="23GiB",
context_bytes="600MiB", required_margin_bytes=0)`.

A configuration fits a card when its device bytes (what the allocator reserves, plus context and
workspaces: what nvidia-smi shows) plus the card's margin are at most its usable bytes
(`fits`); `margin_left` is what remains beyond the margin, so it fits exactly when that is 0 or
more. `budget_bytes` is the same test seen from the allocator: the bytes it may reserve. Where the
reserved peak passes it, the allocator can still run the step by releasing its cached segments
and retrying (`fit_answer`: "yes", "with cache flushes" or "no").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .units import SIZE_HELP, format_bytes, size_bytes, size_label

MiB = 2**20

# Context outside the allocator = a bare CUDA context, ~3 MiB per SM, plus the kernel images a
# step loads (lazily, CUDA >= 11.7). Bare context, measured with cudaMemGetInfo: 555 MiB on a
# 188-SM RTX PRO 6000 Blackwell and 107 MiB on a 34-SM RTX 4060 Ti (ggml-org/llama.cpp PR #23604,
# "the cost scales with SM count"); 256 MiB on an 82-SM RTX 3090 with torch 2.7 (invoke-ai/InvokeAI
# issue #9413). Kernel images: torch's own, all loaded (CUDA_MODULE_LOADING=DEFAULT), took
# 666,632,192 B against 287,047,680 B lazily (pytorch/pytorch PR #86509): a step loads at most
# that difference, 379,584,512 B, which is taken whole (a step may use many kernels; cuBLAS's own
# are outside that count). ptrblck puts the lazily-loaded context at "around 400MB"
# (pytorch/pytorch issue #109888). An estimate: gpu_check measures it on the card it runs on.
CONTEXT_BYTES_PER_SM = 3 * MiB
KERNEL_IMAGES_BYTES = 666_632_192 - 287_047_680

# What torch's cuBLAS handle takes as workspace, through the caching allocator (so it is part of
# reserved, not of the context): ":4096:2:16:8" by default, 32 MiB on Hopper
# (aten/src/ATen/cuda/CublasHandlePool.cpp:131-134, parseChosenWorkspaceSize, at v2.6.0).
CUBLAS_WORKSPACE_BYTES = {8: 4096 * 1024 * 2 + 16 * 1024 * 8, 9: 4096 * 8 * 1024}

# The margin a card keeps: what one card reports as total_memory differs between drivers by up to
# 153 MiB in these reports (RTX 3090: 25,286,672,384 B in Jumperkables/cuda-benchmarking's
# 00_deviceQuery/README.md, 25,447,170,048 B with driver 11.8 in another deviceQuery log; A100-80:
# "81051 MBytes (84987740160 bytes)" with driver 12.2 against 85,100,068,864 B with 12.5), and a
# step allocates a little outside the one stream the replay models (NCCL, cuDNN, a second stream's
# cache). 256 MiB covers both; it is 1% of a 24 GiB card and 0.2% of an H200.
DEFAULT_MARGIN_BYTES = 256 * MiB


@dataclass(frozen=True)
class Card:
    """A capacity: a GPU from the table, or a plain size (arch None: no context, no margin)."""
    name: str                     # "rtx4090", or the size as given ("24GiB")
    label: str                    # "RTX 4090"
    usable_bytes: int             # torch.cuda.get_device_properties().total_memory
    context_bytes: int            # CUDA context and kernel images, outside the caching allocator
    arch: Optional[str]           # "sm89": compute capability 8.9
    sm_count: int = 0
    cublas_workspace_bytes: int = 0   # through the allocator: counts in reserved
    required_margin_bytes: int = 0    # kept free: fits when device bytes + this <= usable bytes

    @property
    def compute_capability(self) -> Optional[tuple[int, int]]:
        return (int(self.arch[2:-1]), int(self.arch[-1])) if self.arch else None

    @property
    def budget_bytes(self) -> int:
        """What the caching allocator may reserve (workspaces included) for a step to fit."""
        return self.usable_bytes - self.context_bytes - self.required_margin_bytes

    @property
    def basis(self) -> str:
        """What a number for this capacity is: "predicted for RTX 4090"; for a plain size, the CPU's
        prediction ("predicted on this CPU for 24.0 GiB")."""
        return f"predicted for {self.label}" if self.arch else f"predicted on this CPU for {self.label}"

    def describe(self) -> str:
        """"RTX 4090 (23.6 GiB usable)", or the size for a plain one: the words of a table's header."""
        return f"{self.label} ({format_bytes(self.usable_bytes)} usable)" if self.arch else self.label


def _card(name: str, label: str, usable_bytes: int, arch: str, sm_count: int) -> Card:
    major = int(arch[2:-1])
    return Card(name, label, usable_bytes, CONTEXT_BYTES_PER_SM * sm_count + KERNEL_IMAGES_BYTES, arch, sm_count,
                CUBLAS_WORKSPACE_BYTES[major], DEFAULT_MARGIN_BYTES)


# usable_bytes: totalGlobalMem as CUDA's deviceQuery prints it ("N MBytes (B bytes)"), which is
# what torch reports as total_memory; nvidia-smi's "MiB" total is larger (it counts memory the
# driver keeps). SM counts from the same logs.
_CARDS = (
    # thamada/nvidia-smi gls/RTX3090_deviceQuery.py, driver 12.6: "24154 MBytes (25327697920 bytes)", 82 SMs
    _card("rtx3090", "RTX 3090", 25_327_697_920, "sm86", 82),
    # thamada/nvidia-smi gls/RTX4090_deviceQuery.py, driver 12.4: "24210 MBytes (25386352640 bytes)", 128 SMs
    _card("rtx4090", "RTX 4090", 25_386_352_640, "sm89", 128),
    # aalanwyr/face2cuda step2cuda/README.md, "NVIDIA A10", driver 12.2: "21.99 GBytes (23609475072 bytes)", 72 SMs
    _card("a10", "A10", 23_609_475_072, "sm86", 72),
    # thamada/nvidia-smi gls/L4_deviceQuery.py, driver 12.4: "22478 MBytes (23570219008 bytes)", 58 SMs
    _card("l4", "L4", 23_570_219_008, "sm89", 58),
    # Only MiB known: PaddlePaddle's get_device_properties docstring prints the same property as
    # "_gpuDeviceProperties(name='A100-SXM4-40GB', major=8, minor=0, total_memory=40536MB,
    # multi_processor_count=108)", MB meaning MiB, rounded down: 40536 MiB (within 1 MiB below)
    _card("a100-40", "A100-40", 40_536 * MiB, "sm80", 108),
    # thamada/nvidia-smi gls/A100SXMx4_deviceQuery.py, A100-SXM4-80GB, driver 12.5:
    # "81158 MBytes (85100068864 bytes)", 108 SMs
    _card("a100-80", "A100-80", 85_100_068_864, "sm80", 108),
    # thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py, "NVIDIA H100 80GB HBM3" (SXM), driver 12.7:
    # "81106 MBytes (85045477376 bytes)", 132 SMs (torch prints 81082-81090 MB for it elsewhere)
    _card("h100-80", "H100-80 (SXM)", 85_045_477_376, "sm90", 132),
    # Only MiB known: torch's own print in a public vLLM-on-Modal example (skywork_r1v.py):
    # "_CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0, total_memory=143156MB,
    # multi_processor_count=132, ...)", MB meaning MiB, rounded down: 143156 MiB
    _card("h200", "H200", 143_156 * MiB, "sm90", 132),
)
_BY_NAME = {c.name: c for c in _CARDS}

# The cards an answer covers when none is named: one of each size of the old 24/40/80/141 GiB set.
DEFAULT_CARDS = ("rtx4090", "a100-40", "h100-80", "h200")
CAPACITY_HELP = f"a card ({', '.join(_BY_NAME)}) or {SIZE_HELP}"


def cards() -> list[Card]:
    """The table of cards, as records: name, label, usable bytes, context bytes, arch, SMs,
    cuBLAS workspace, required margin."""
    return list(_CARDS)


def card(name: str) -> Card:
    """The card of that name; ValueError naming the allowed names."""
    if isinstance(name, str) and name.strip().lower() in _BY_NAME:
        return _BY_NAME[name.strip().lower()]
    raise ValueError(f"card={name!r} is invalid: allowed are {', '.join(_BY_NAME)}")


def card_budgets(names=DEFAULT_CARDS) -> dict[str, int]:
    """{card name: budget bytes}: the memory limits a measured peak is compared with per card."""
    return {n: card(n).budget_bytes for n in names}


def parse_capacity(value, name: str = "capacity", usable_bytes=None, context_bytes=None,
                   required_margin_bytes=None) -> Card:
    """A card name, a `Card`, or a size (24GiB, 512MiB, a number of bytes; as text, with its unit:
    "24" could mean GB or GiB) -> a Card; the keyword arguments replace the card's usable bytes,
    context and margin (sizes, or 0 for context and margin). ValueError naming `name`, the value
    and what is allowed."""
    if isinstance(value, Card):
        capacity = value
    elif isinstance(value, str) and value.strip().lower() in _BY_NAME:
        capacity = _BY_NAME[value.strip().lower()]
    else:
        if isinstance(value, str) and _positive_number(value):   # "24": GB or GiB? a typed size says its unit
            raise ValueError(f"{name}={value!r} is invalid: a size needs its unit; allowed is a card "
                             f"({', '.join(_BY_NAME)}) or a size such as {value.strip()}GiB or {value.strip()}GB")
        try:
            n_bytes = size_bytes(name, value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is invalid: allowed is {CAPACITY_HELP}") from None
        text = value.strip() if isinstance(value, str) else size_label(n_bytes)
        capacity = Card(text, format_bytes(n_bytes), n_bytes, 0, None)
    changes = {"usable_bytes": usable_bytes, "context_bytes": context_bytes,
               "required_margin_bytes": required_margin_bytes}
    changes = {k: _bytes(k, v, minimum=1 if k == "usable_bytes" else 0) for k, v in changes.items() if v is not None}
    return replace(capacity, **changes) if changes else capacity


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _bytes(name: str, value, minimum: int) -> int:
    if minimum == 0 and not isinstance(value, bool) and value in (0, "0"):
        return 0
    return size_bytes(name, value)


def margin_left(capacity: Card, device_bytes: int) -> int:
    """What is left of the card beyond its required margin: usable bytes - the margin - device
    bytes. `fits` exactly when it is 0 or more."""
    return capacity.usable_bytes - capacity.required_margin_bytes - device_bytes


def fits(capacity: Card, device_bytes: int) -> bool:
    """Device bytes plus the card's margin are at most its usable bytes: `margin_left` >= 0."""
    return margin_left(capacity, device_bytes) >= 0


# The answers to "does it fit": with its reserved peak; only by the caching allocator's release of
# its cached segments and a retry, step after step (slower: PyTorch warns of it); not at all.
FIT_ANSWERS = ("yes", "with cache flushes", "no")


def fit_answer(capacity: Card, device_bytes: int, runs_under_limit: bool) -> str:
    """"yes" when the device bytes fit, else "with cache flushes" when the step, replayed under
    the card's limit with the allocator's release-and-retry path, runs (`runs_under_limit`),
    else "no"."""
    if fits(capacity, device_bytes):
        return "yes"
    return "with cache flushes" if runs_under_limit else "no"


__all__ = ["CAPACITY_HELP", "Card", "DEFAULT_CARDS", "DEFAULT_MARGIN_BYTES", "FIT_ANSWERS", "card", "card_budgets", "cards",
           "fit_answer", "fits", "margin_left", "parse_capacity"]
