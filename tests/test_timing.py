"""The timing protocol: bootstrap intervals on synthetic data with a known answer; interleaving,
rotation, pairing and the stopping rule on steps of known duration."""

import numpy as np
import pytest
import torch

from ckptlab.probe.timing import (
    bootstrap_median,
    paired_ratio,
    time_interleaved,
    time_steps,
    unpaired_median_ratio,
    versus_fastest_at_no_more_memory,
)


class FakeClock:
    """A clock that only the steps advance: durations are exactly what a test says they are."""

    def __init__(self):
        self.now = 0.0
        self.drift = 1.0   # the machine's slowness this round: scales every step alike

    def __call__(self):
        return self.now

    def step(self, ms: float, jitter=None):
        def run():
            self.now += ms / 1e3 * self.drift * (1 if jitter is None else next(jitter))
        return run


def test_bootstrap_interval_covers_the_known_median_and_is_deterministic():
    rng = np.random.default_rng(1)
    # Log-normal with median exp(0) = 1: 200 draws, 40 independent samples.
    covered = 0
    for _ in range(40):
        sample = rng.lognormal(0.0, 0.3, size=200)
        median, low, high = bootstrap_median(sample, seed=0)
        assert low <= median <= high
        covered += low <= 1.0 <= high
    # A 95% interval: ~38 of 40 cover; fewer than 33 has probability < 1e-3 (binomial).
    assert covered >= 33
    assert bootstrap_median(sample, seed=0) == bootstrap_median(sample, seed=0)
    # The interval narrows as the sample grows (about 1/sqrt(n)).
    _, low_small, high_small = bootstrap_median(sample[:20], seed=0)
    assert (high - low) < (high_small - low_small)


def test_bootstrap_of_constant_values_is_that_value():
    assert bootstrap_median([2.5] * 7) == (2.5, 2.5, 2.5)


@pytest.mark.parametrize("values", [[], [1.0, float("nan")], [[1.0, 2.0]]])
def test_bootstrap_rejects_bad_values(values):
    with pytest.raises(ValueError, match="values=.* is invalid"):
        bootstrap_median(values)


def test_rounds_rotate_and_run_every_configuration_once():
    calls = []
    configs = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    result = time_interleaved(configs, warmup=1, min_rounds=4, max_rounds=4)
    assert result.rounds == 4 and result.stopped == "max_rounds"
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 5  # one warm-up round, four timed
    assert [r[0] for r in rounds[1:]] == ["a", "b", "c", "a"]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


def test_pairing_cancels_drift_that_hits_every_configuration_alike():
    """The machine slows down by up to 3x from round to round (a noisy neighbour), the same for
    every configuration in a round: the paired ratio is still exactly 2 and 1, while the step
    times themselves spread widely."""
    clock = FakeClock()
    drifts = iter(np.random.default_rng(0).uniform(1.0, 3.0, size=1000))
    calls = [0]

    def timed(ms):
        def run():
            if calls[0] % 3 == 0:  # a new round: the machine's speed changes
                clock.drift = next(drifts)
            calls[0] += 1
            clock.step(ms)()
        return run

    result = time_interleaved({"base": timed(2), "double": timed(4), "same": timed(2)}, min_rounds=8,
                              max_rounds=40, max_seconds=60, clock=clock)
    assert result.baseline == "base" and result.ratio["base"] == 1.0
    assert result.stopped == "target" and result.rounds == 15   # 5 complete cycles of the 3 configurations
    assert (result.ratio_low["double"], result.ratio_high["double"]) == pytest.approx((2.0, 2.0))
    assert (result.ratio_low["same"], result.ratio_high["same"]) == pytest.approx((1.0, 1.0))
    assert result.significant("double") and not result.significant("same")
    assert result.step_ms_high["base"] / result.step_ms_low["base"] > 1.2   # the times alone are noisy
    row = result.row("double")
    assert row["step_ms_low"] <= row["step_ms"] <= row["step_ms_high"]
    assert row["rounds"] == result.rounds and row["timing_baseline"] == "base"


def test_paired_ratio_of_known_durations_with_independent_noise():
    clock = FakeClock()
    jitter = iter(np.random.default_rng(3).lognormal(0.0, 0.05, size=10_000))
    result = time_interleaved({"base": clock.step(10, jitter), "slower": clock.step(13, jitter),
                               "same": clock.step(10, jitter)}, min_rounds=5, max_rounds=400, max_seconds=1e6,
                              clock=clock)
    assert result.stopped == "target" and result.ci_half_width < 0.02
    assert result.ratio_low["slower"] <= 1.3 <= result.ratio_high["slower"]
    assert result.ratio_low["same"] <= 1.0 <= result.ratio_high["same"] and not result.significant("same")


def test_paired_ratio_of_stored_rows_takes_the_cycles_their_timing_took():
    """Two identical steps, the one opening each round 10% slower: rows that say they were timed
    in cycles of two give exactly 1 (five rounds: two cycles, the fifth round left out)."""
    base = [11.0, 10.0, 11.0, 10.0, 11.0]
    other = [10.0, 11.0, 10.0, 11.0, 10.0]
    ratio = paired_ratio({"round_ms": other, "timing_cycle": 2}, {"round_ms": base, "timing_cycle": 2})
    assert ratio == pytest.approx((1.0, 1.0, 1.0))
    assert paired_ratio({"round_ms": other}, {"round_ms": base})[0] == pytest.approx(10 / 11)   # per round
    # a DataFrame row holds numpy integers
    assert paired_ratio({"round_ms": other, "timing_cycle": np.int64(2)}, {"round_ms": base}) == pytest.approx((1, 1, 1))


def test_the_summary_takes_every_round_timed_where_the_loop_stops_inside_a_cycle():
    """Two configurations, rounds of 1, 2 and 9 ms for the first: three rounds end inside the
    second cycle, and its step time is the median of all three, 2 ms, as `times_ms` holds them."""
    clock = FakeClock()
    a, b = iter([1, 2, 9]), iter([5, 5, 5])
    result = time_interleaved({"a": lambda: clock.step(next(a))(), "b": lambda: clock.step(next(b))()},
                              warmup=0, min_rounds=1, max_rounds=3, max_seconds=1e6, clock=clock)
    assert result.rounds == 3 and result.times_ms["a"] == [1, 2, 9]
    assert result.step_ms["a"] == pytest.approx(2.0)


def test_the_fastest_rival_at_no_more_memory_is_paired_round_by_round():
    plan = {"policy": "plan", "peak_bytes": 100, "step_ms": 12.0, "round_ms": [12.0, 12.0, 12.0]}
    rivals = [{"policy": "small-slow", "peak_bytes": 90, "step_ms": 16.0, "round_ms": [16.0, 16.0, 16.0]},
              {"policy": "small-fast", "peak_bytes": 100, "step_ms": 15.0, "round_ms": [15.0, 15.0, 15.0]},
              {"policy": "large-fast", "peak_bytes": 101, "step_ms": 1.0, "round_ms": [1.0, 1.0, 1.0]}]
    best, (ratio, low, high) = versus_fastest_at_no_more_memory(plan, rivals)
    assert best["policy"] == "small-fast" and ratio == low == high == pytest.approx(0.8)
    none, interval = versus_fastest_at_no_more_memory(plan, rivals[2:])
    assert none is None and all(np.isnan(interval))


def test_stops_at_the_time_budget_after_the_minimum_rounds():
    clock = FakeClock()
    jitter = iter(np.random.default_rng(4).lognormal(0.0, 0.5, size=10_000))
    budget = time_interleaved({"a": clock.step(5, jitter), "b": clock.step(5, jitter)}, min_rounds=3,
                              max_rounds=500, target_ci=1e-9, max_seconds=0.1, clock=clock)
    assert budget.stopped == "max_seconds" and 3 <= budget.rounds < 20 and budget.seconds <= 0.1 + 0.05
    assert budget.ci_half_width >= 1e-9
    short = time_interleaved({"a": clock.step(5, jitter)}, min_rounds=4, max_rounds=500, max_seconds=1e-9, clock=clock)
    assert short.rounds == 4  # the minimum is never cut short


def test_threads_are_set_recorded_and_restored_and_load_is_recorded():
    before = torch.get_num_threads()
    seen = []
    result = time_interleaved({"a": lambda: seen.append(torch.get_num_threads())}, threads=1, min_rounds=2,
                              max_rounds=2)
    assert set(seen) == {1} and result.threads == 1 and torch.get_num_threads() == before
    assert result.load_before >= 0 and result.load_after >= 0


@pytest.mark.parametrize("load, busy", [(0.5, False), (64.0, True)])
def test_busy_means_more_load_than_cores(monkeypatch, load, busy):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    result = time_interleaved({"a": lambda: None}, min_rounds=2, max_rounds=2)
    assert (result.load_before, result.busy) == (load, busy)


@pytest.mark.parametrize("kwargs, match", [
    ({"target_ci": 0}, "target_ci=0 is invalid"), ({"max_seconds": -1}, "max_seconds=-1 is invalid"),
    ({"min_rounds": 0}, "min_rounds=0 is invalid"), ({"threads": 0}, "threads=0 is invalid"),
    ({"min_rounds": 5, "max_rounds": 3}, "max_rounds=3 is invalid"),
])
def test_bad_options_are_refused_before_running(kwargs, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        time_interleaved({"a": lambda: calls.append(1)}, **kwargs)
    assert not calls


def test_time_steps_runs_exactly_the_steps_asked_and_gives_the_record_columns():
    calls = []
    timing = time_steps(lambda: calls.append(1), steps=3, warmup=2)
    assert len(calls) == 5 and len(timing.times_ms["step"]) == 3 and timing.rounds == 3
    row = timing.row("step")
    assert row["step_ms_low"] <= row["step_ms"] <= row["step_ms_high"]
    assert row["rounds"] == 3 and row["threads"] == torch.get_num_threads() and isinstance(row["busy"], bool)
    assert row["time_ratio"] is None and row["significant"] is None  # timed alone: no ratio


def test_unpaired_ratio_of_medians_on_synthetic_samples_with_known_answers():
    rng = np.random.default_rng(3)
    slow, fast = rng.normal(150, 3, size=12), rng.normal(100, 2, size=9)   # medians ~150 and ~100
    ratio, low, high = unpaired_median_ratio(slow, fast, seed=0)
    assert ratio == pytest.approx(np.median(slow) / np.median(fast))
    assert low <= 1.5 <= high and low > 1 and high - low < 0.1
    assert unpaired_median_ratio(slow, fast, seed=0) == (ratio, low, high)   # seeded: the same interval
    # Two samples from one distribution: the interval contains 1, for 19 of 20 draws or more.
    contains_one = 0
    for _ in range(20):
        a, b = rng.lognormal(np.log(100), 0.05, size=10), rng.lognormal(np.log(100), 0.05, size=10)
        r, lo, hi = unpaired_median_ratio(a, b, seed=0)
        assert lo <= r <= hi
        contains_one += lo <= 1 <= hi
    assert contains_one >= 17   # a 95% interval: ~19 of 20; under 17 has probability < 2% (binomial)
    # Unpaired is wider than paired on data whose pairs share a drift: the pairing would hide it.
    drift = np.linspace(80, 120, 10)
    paired = bootstrap_median(1.2 * drift / drift)
    _, u_low, u_high = unpaired_median_ratio(1.2 * drift, drift)
    assert paired[2] - paired[1] == 0 and u_high - u_low > 0.2


@pytest.mark.parametrize("values, baseline, match", [
    ([], [1.0], "values=\\[\\] is invalid"), ([1.0], [0.0], "baseline=\\[0.0\\] is invalid"),
    ([1.0, float("nan")], [1.0], "values=.* is invalid"),
])
def test_unpaired_ratio_refuses_what_is_not_a_sample_of_times(values, baseline, match):
    with pytest.raises(ValueError, match=match):
        unpaired_median_ratio(values, baseline)


def test_a_single_round_has_a_value_but_no_interval():
    clock = FakeClock()
    result = time_interleaved({"a": clock.step(3), "b": clock.step(6)}, min_rounds=1, max_rounds=1, clock=clock)
    assert result.rounds == 1 and result.ratio["b"] == pytest.approx(2.0)
    assert np.isnan(result.ratio_low["b"]) and np.isnan(result.step_ms_high["a"])
    assert result.ci_half_width == float("inf") and not result.significant("b")


def test_the_target_is_not_reached_on_fewer_rounds_than_an_interval_needs():
    clock = FakeClock()
    result = time_interleaved({"a": clock.step(3), "b": clock.step(3)}, min_rounds=1, max_rounds=100, clock=clock)
    assert result.stopped == "target" and result.rounds == 10   # 5 cycles of two rounds, one ratio each
    alone = time_interleaved({"a": clock.step(3)}, min_rounds=1, max_rounds=100, clock=clock)
    assert alone.stopped == "target" and alone.rounds == 5


@pytest.mark.parametrize("configs", [2, 3])
def test_a_slower_first_step_of_each_round_does_not_bias_an_a_a_ratio(configs):
    """The step that opens a round runs after the protocol's own work (the interval computed
    between rounds) and finds colder caches: here 10% slower. Identical steps must still have a
    ratio of exactly 1, whatever the number of rounds (an odd one puts one order once more)."""
    clock = FakeClock()
    calls = [0]

    def same_step():
        clock.step(10 * (1.1 if calls[0] % configs == 0 else 1.0))()
        calls[0] += 1

    names = "abc"[:configs]
    for rounds in (5 * configs, 5 * configs + 1):
        calls[0] = 0
        result = time_interleaved({n: same_step for n in names}, warmup=0, min_rounds=rounds, max_rounds=rounds,
                                  clock=clock)
        for name in names[1:]:
            assert (result.ratio[name], result.ratio_low[name], result.ratio_high[name]) == pytest.approx((1, 1, 1))
            assert not result.significant(name)


def test_a_measured_step_time_carries_its_interval_threads_and_load():
    from ckptlab import measure

    record = measure("mlp-chain", 2, 8, "none", steps=3, warmup=1, max_seconds=0.5)
    assert record["step_ms_low"] <= record["step_ms"] <= record["step_ms_high"]
    assert record["rounds"] >= 3 and record["threads"] == torch.get_num_threads()
    assert record["load_before"] >= 0 and isinstance(record["busy"], bool)
    assert record["time_ratio"] is None and record["timing_baseline"] is None  # timed alone: no ratio


def test_cuda_events_are_recorded_on_the_stream_of_the_device_the_step_runs_on(monkeypatch):
    """cuda:1 while cuda:0 is current: events without a device would go on cuda:0's stream and
    time nothing of the step. The CUDA calls are stood in for, so this runs without a GPU."""
    current, log = ["cuda:0"], []

    class Device:   # torch.cuda.device(dev): dev is current inside
        def __init__(self, dev):
            self.dev = str(dev)

        def __enter__(self):
            self.before, current[0] = current[0], self.dev

        def __exit__(self, *exc):
            current[0] = self.before

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            log.append(("record", stream, current[0]))
            self.at = len(log)

        def elapsed_time(self, end):
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: f"stream of {dev}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: log.append(("synchronize", str(dev), current[0])))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    result = time_interleaved({"step": lambda: log.append(("step", None, current[0]))}, device="cuda:1", warmup=0,
                              min_rounds=1, max_rounds=1)
    assert log == [("synchronize", "cuda:1", "cuda:1"), ("record", "stream of cuda:1", "cuda:1"),
                   ("step", None, "cuda:1"), ("record", "stream of cuda:1", "cuda:1"),
                   ("synchronize", "cuda:1", "cuda:1")]
    assert result.times_ms["step"] == [2.0] and current[0] == "cuda:0"


def test_every_round_reports_the_widest_half_width_reached_so_far():
    clock = FakeClock()
    jitter = iter(np.random.default_rng(5).lognormal(0.0, 0.05, size=10_000))
    seen = []
    result = time_interleaved({"base": clock.step(10, jitter), "other": clock.step(12, jitter)}, min_rounds=5,
                              max_rounds=400, max_seconds=1e6, clock=clock, on_round=lambda r, w: seen.append((r, w)))
    assert [r for r, _ in seen] == list(range(1, result.rounds + 1))
    assert seen[0][1] == float("inf") and seen[-1][1] == result.ci_half_width < 0.02
