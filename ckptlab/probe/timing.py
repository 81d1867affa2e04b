"""The timing protocol: interleaved rounds, paired ratios, bootstrap intervals, adaptive length.

    result = time_interleaved({"none": step_none, "full": step_full}, device="cpu")
    result.ratio["full"], result.ratio_low["full"], result.ratio_high["full"]

Every configuration runs once per round, in an order rotated each round; a time ratio to the
first configuration is the median of its ratios over complete rotations (a cycle: as many rounds
as configurations, each one in every position once) with its 95% bootstrap interval, and cycles
go on until the interval is narrow enough or the time budget ends. Why this and not
`torch.utils.benchmark.Timer`: docs/design.md, note "The timing protocol".
"""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
# Fewer samples than this (rounds of one configuration timed alone, cycles of several) give a
# bootstrap interval too coarse to stop on (one sample: a point), so reaching the target needs at
# least this many; the time budget may stop earlier.
MIN_SAMPLES_FOR_TARGET = 5


def check_timing_options(target_ci, max_seconds) -> None:
    """The two knobs users pass for the protocol, checked before any work."""
    if isinstance(target_ci, bool) or not isinstance(target_ci, (int, float)) or not 0 < target_ci < 1:
        raise ValueError(f"target_ci={target_ci!r} is invalid: allowed is a number in (0, 1), e.g. 0.02 for ±2%")
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0:
        raise ValueError(f"max_seconds={max_seconds!r} is invalid: allowed is a number of seconds > 0")


def bootstrap_median(values, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(median, low, high): the median of `values` and its percentile-bootstrap interval, from a
    seeded numpy generator (the same values give the same interval)."""
    import numpy as np  # noqa: PLC0415 - numpy is not torch's dependency: `import ckptlab` needs only torch

    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"values={values!r} is invalid: allowed is a non-empty 1-d sequence of finite numbers")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} is invalid: allowed is a number in (0, 1)")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(np.median(x)), float(low), float(high)


def paired_ratio(row, versus, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): `row`'s time over `versus`'s from their per-round times (`round_ms`),
    paired round by round and taken per rotation cycle as `time_interleaved` takes them (its rows'
    `timing_cycle`; a row without it, per round); the two were timed in the same interleaved
    rounds (one `compare`, or one timing group of a sweep). NaN where either has no round times."""
    import numpy as np  # noqa: PLC0415 - numpy is not torch's dependency: `import ckptlab` needs only torch

    a, b = (np.asarray(r.get("round_ms") if isinstance(r.get("round_ms"), list) else [], dtype=float)
            for r in (row, versus))
    if len(a) == 0 or len(a) != len(b):
        return math.nan, math.nan, math.nan
    cycle = row.get("timing_cycle")
    cycle = int(cycle) if isinstance(cycle, numbers.Real) and not isinstance(cycle, bool) and cycle >= 1 else 1
    return bootstrap_median(_cycle_ratios(a / b, cycle), seed)


def versus_fastest_at_no_more_memory(row, rivals: Sequence) -> tuple[Optional[Mapping], tuple[float, float, float]]:
    """The fastest of `rivals` (least `step_ms`) among those holding no more memory than `row`
    (`peak_bytes`), and `row`'s time over its, paired round by round (`paired_ratio`): (None,
    NaNs) when no rival is that small. Rows are mappings (dicts, pandas Series) timed together."""
    smaller = [r for r in rivals if r["peak_bytes"] <= row["peak_bytes"]]
    if not smaller:
        return None, (math.nan, math.nan, math.nan)
    best = min(smaller, key=lambda r: r["step_ms"])
    return best, paired_ratio(row, best)


NO_DIFFERENCE = "no difference"


def time_verdict(low: float, high: float, reference: float = 1.0) -> str:
    """What a 95% interval of a time ratio says against `reference` (1: the same time): "faster"
    when it lies below, "slower" when above, "no difference" when it contains the reference or is
    unknown (NaN). The one place a verdict is read from an interval."""
    if high < reference:
        return "faster"
    if low > reference:
        return "slower"
    return NO_DIFFERENCE


def unpaired_median_ratio(values, baseline, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                          confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(ratio, low, high): median(values) / median(baseline) and its percentile-bootstrap interval,
    each sample resampled on its own (seeded, like `bootstrap_median`).

    For two samples taken one after the other, not in interleaved rounds: the i-th value of one
    has nothing to do with the i-th of the other, so pairing them (as `time_interleaved` pairs
    the members of a round) would claim a cancellation of drift that never happened. The unpaired
    interval is wider; that width is the honest price of not interleaving. The samples may differ
    in length."""
    import numpy as np  # noqa: PLC0415 - numpy is not torch's dependency: `import ckptlab` needs only torch

    x, base = (np.asarray(v, dtype=float) for v in (values, baseline))
    for name, given, arr in (("values", values, x), ("baseline", baseline, base)):
        if arr.ndim != 1 or len(arr) == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise ValueError(f"{name}={given!r} is invalid: allowed is a non-empty 1-d sequence of positive "
                             "finite numbers (times)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} is invalid: allowed is a number in (0, 1)")
    rng = np.random.default_rng(seed)
    ratios = (np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
              / np.median(base[rng.integers(0, len(base), size=(resamples, len(base)))], axis=1))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(np.median(x) / np.median(base)), float(low), float(high)

@dataclass
class IntervalTiming:
    """What `time_interleaved` measured. Per configuration name: the per-round times (ms), the
    median step time with its interval, and the time ratio to the baseline with its interval
    (the baseline's own ratio is exactly 1)."""

    names: list[str]
    times_ms: dict[str, list[float]]
    step_ms: dict[str, float]
    step_ms_low: dict[str, float]
    step_ms_high: dict[str, float]
    ratio: dict[str, float]
    ratio_low: dict[str, float]
    ratio_high: dict[str, float]
    rounds: int
    target_ci: float
    ci_half_width: float          # the largest relative half-width reached (ratios, or the
    stopped: str                  # baseline's step time when it is timed alone); why it stopped:
    threads: int                  # "target", "max_seconds" or "max_rounds"
    load_before: float
    load_after: float
    cpu_count: int
    seconds: float
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> str:
        return self.names[0]

    @property
    def busy(self) -> bool:
        """The machine's load exceeded its cores: other work competed for the CPU."""
        return max(self.load_before, self.load_after) > self.cpu_count

    def significant(self, name: str) -> bool:
        """The interval excludes 1: `name` differs in time from the baseline."""
        return time_verdict(self.ratio_low[name], self.ratio_high[name]) != NO_DIFFERENCE

    def row(self, name: str) -> dict:
        """The record columns for one configuration (a configuration timed alone has no ratio)."""
        alone = len(self.names) == 1
        return {
            "step_ms": self.step_ms[name], "step_ms_low": self.step_ms_low[name],
            "step_ms_high": self.step_ms_high[name],
            "step_ms_min": min(self.times_ms[name]), "step_ms_max": max(self.times_ms[name]),
            "time_ratio": None if alone else self.ratio[name],
            "time_ratio_low": None if alone else self.ratio_low[name],
            "time_ratio_high": None if alone else self.ratio_high[name],
            "significant": None if alone else self.significant(name),
            "timing_baseline": None if alone else self.baseline, "timing_cycle": len(self.names),
            "rounds": self.rounds, "timing_target_ci": self.target_ci,
            "timing_ci_half_width": self.ci_half_width, "timing_stopped": self.stopped,
            "threads": self.threads, "load_before": self.load_before, "load_after": self.load_after,
            "busy": self.busy,
        }


def time_interleaved(configs: Mapping[str, Callable[[], object]], *, device: torch.device | str = "cpu",
                     warmup: int = 1, target_ci: float = 0.02, max_seconds: float = 60.0,
                     min_rounds: int = 5, max_rounds: int = 200, threads: Optional[int] = None,
                     seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                     on_round: Optional[Callable[[int, float], None]] = None) -> IntervalTiming:
    """Time `configs` (name -> zero-argument step; the first is the baseline) with the protocol of
    docs/design.md, note "The timing protocol". `threads` defaults to PyTorch's current setting;
    it is set for the measurement, restored after, and recorded. `min_rounds` are always run (the
    time budget does not cut them short); at most `max_rounds`. `clock` (seconds) times CPU steps
    and the budget; a test can hand in a clock it controls. `on_round(rounds, half_width)` is called
    after every timed round with the widest relative interval half-width so far (inf before an
    interval exists), for a progress bar. Between `min_rounds` and `max_rounds`, timing stops only
    after a complete cycle (`_cycle_ratios`)."""
    names = list(configs)
    if not names:
        raise ValueError("configs={} is invalid: allowed is a mapping of at least one name to a step function")
    for name, value, low in (("warmup", warmup, 0), ("min_rounds", min_rounds, 1), ("max_rounds", max_rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is invalid: allowed is an integer >= {low}")
    if max_rounds < min_rounds:
        raise ValueError(f"max_rounds={max_rounds} is invalid: allowed is an integer >= min_rounds={min_rounds}")
    check_timing_options(target_ci, max_seconds)
    threads = torch.get_num_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} is invalid: allowed is an integer >= 1")
    device = torch.device(device)
    timer = _cuda_timer(device) if device.type == "cuda" else _cpu_timer(clock)

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    t0 = clock()
    times: dict[str, list[float]] = {n: [] for n in names}
    stopped, summary = "max_rounds", None
    cycle = len(names)
    try:
        for r in range(warmup):
            for name in _rotated(names, r):
                configs[name]()
        for r in range(max_rounds):
            if r % cycle == 0:
                cycle_start = clock()
            for name in _rotated(names, r):
                times[name].append(timer(configs[name]))
            rounds = r + 1
            may_stop = rounds >= min_rounds and rounds % cycle == 0
            if on_round is not None or may_stop:
                summary = _summarize(times, names, seed)
            if on_round is not None:
                on_round(rounds, summary["half_width"])
            if not may_stop:
                continue
            # the target is judged on ratios per cycle: two cycles at least (one is per round)
            if (cycle == 1 or rounds >= 2 * cycle) and summary["samples"] >= MIN_SAMPLES_FOR_TARGET \
                    and summary["half_width"] < target_ci:
                stopped = "target"
                break
            now = clock()
            if rounds < max_rounds and (now - t0) + (now - cycle_start) > max_seconds:
                stopped = "max_seconds"
                break
    finally:
        torch.set_num_threads(previous_threads)
    load_after = os.getloadavg()[0]
    summary = _summarize(times, names, seed)   # of every round timed, whichever round the loop stopped at
    return IntervalTiming(
        names=names, times_ms=times, step_ms=summary["step"], step_ms_low=summary["step_low"],
        step_ms_high=summary["step_high"], ratio=summary["ratio"], ratio_low=summary["ratio_low"],
        ratio_high=summary["ratio_high"], rounds=len(times[names[0]]), target_ci=float(target_ci),
        ci_half_width=summary["half_width"], stopped=stopped, threads=threads, load_before=load_before,
        load_after=load_after, cpu_count=os.cpu_count() or 1, seconds=clock() - t0,
        device=str(device))


def _rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def _cycle_ratios(ratios, cycle: int):
    """Per-round ratios made into one ratio per complete cycle of `cycle` rounds: their geometric
    mean. Within a cycle each configuration runs once in every position of the round, so an effect
    of the position cancels: the first step of a round runs after the protocol's own work and
    finds colder caches, and with two configurations the first also repeats the previous round's
    last. Per round, such an effect splits the ratios of an A/A pair into two clusters, one per
    order, and their median falls in the cluster of the order that ran once more; an interval
    around it can exclude 1. Rounds past the last complete cycle are left out; with fewer than
    two cycles, the per-round ratios as they are (no cancellation, an interval of few samples)."""
    import numpy as np  # noqa: PLC0415 - numpy is not torch's dependency: `import ckptlab` needs only torch

    cycles = len(ratios) // cycle
    if cycle == 1 or cycles < 2:
        return ratios
    return np.exp(np.log(ratios[:cycles * cycle]).reshape(cycles, cycle).mean(axis=1))


def _summarize(times: dict[str, list[float]], names: list[str], seed: int) -> dict:
    """Medians and intervals; a single round has no interval (NaN), only a value. `samples`: how
    many values the widest interval rests on (rounds timed alone, else `_cycle_ratios`)."""
    import numpy as np  # noqa: PLC0415 - numpy is not torch's dependency: `import ckptlab` needs only torch

    base = np.asarray(times[names[0]])
    out = {k: {} for k in ("step", "step_low", "step_high", "ratio", "ratio_low", "ratio_high")}
    widths = []
    out["samples"] = len(base)
    for name in names:
        t = np.asarray(times[name])
        out["step"][name], out["step_low"][name], out["step_high"][name] = _median_interval(t, seed)
        if name == names[0]:
            out["ratio"][name] = out["ratio_low"][name] = out["ratio_high"][name] = 1.0
            continue
        ratios = _cycle_ratios(t / base, len(names))
        out["samples"] = len(ratios)
        ratio, low, high = _median_interval(ratios, seed)
        out["ratio"][name], out["ratio_low"][name], out["ratio_high"][name] = ratio, low, high
        widths.append((high - low) / 2 / ratio)
    if not widths:  # one configuration: how well its own median step time is known
        step = out["step"][names[0]]
        widths.append((out["step_high"][names[0]] - out["step_low"][names[0]]) / 2 / step)
    out["half_width"] = float(max(widths)) if not any(math.isnan(w) for w in widths) else math.inf
    return out


def _median_interval(values, seed: int) -> tuple[float, float, float]:
    if len(values) < 2:
        return (float(values[0]) if len(values) else math.nan), math.nan, math.nan
    return bootstrap_median(values, seed)


def _cpu_timer(clock: Callable[[], float]) -> Callable[[Callable[[], object]], float]:
    def timer(step):
        t0 = clock()
        step()
        return (clock() - t0) * 1e3
    return timer


def _cuda_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Events on `device`'s current stream, the step run with `device` current: an event recorded
    without a device would go on the current device's stream and time nothing of a step that runs
    on another card (cuda:1 while cuda:0 is current)."""
    def timer(step):
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record(stream)
            step()
            end.record(stream)
            torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    return timer


def time_steps(step: Callable[[], object], steps: int, warmup: int, device: torch.device | str = "cpu",
               target_ci: float = 0.02) -> IntervalTiming:
    """Exactly `steps` timed runs of one step after `warmup` untimed ones: the protocol with one
    configuration and a fixed round count, for callers whose processes must run the same number
    of steps (the sharded ranks step in lockstep, so no rank may stop on its own interval). The
    result is `time_interleaved`'s with one name, "step": `times_ms["step"]` holds every step's
    time, `row("step")` the record columns (median with its 95% interval, threads, load).
    `target_ci` only labels the result: `stopped` is "target" when the interval reached it within
    the `steps` rounds, else "max_rounds"."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid: allowed is an integer >= 1")
    return time_interleaved({"step": step}, device=device, warmup=warmup, target_ci=target_ci, min_rounds=steps,
                            max_rounds=steps, max_seconds=math.inf)


__all__ = ["IntervalTiming", "bootstrap_median", "check_timing_options", "paired_ratio", "time_interleaved", "time_steps",
           "unpaired_median_ratio", "versus_fastest_at_no_more_memory"]
