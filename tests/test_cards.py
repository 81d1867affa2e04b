"""Cards by what they offer: the table, the one capacity parser, and card names accepted wherever a
capacity is (predict_fits, lora_fits, explain, the notebooks' parameters, the command line)."""

import dataclasses
import json

import pandas as pd
import pytest

import ckptlab
from ckptlab import predict, predict_fits
from ckptlab.apps.cli import main as cli_main
from ckptlab.apps.cli import or_more
from ckptlab.apps.notebooks import _value_checks
from ckptlab.core.cards import (
    CONTEXT_BYTES_PER_SM,
    DEFAULT_CARDS,
    DEFAULT_MARGIN_BYTES,
    KERNEL_IMAGES_BYTES,
    Card,
    card,
    cards,
    fit_answer,
    fits,
    margin_left,
    parse_capacity,
)
from ckptlab.run.finetune import longest_fitting, lora_fits

GiB, MiB = 2**30, 2**20
NAMES = ["rtx3090", "rtx4090", "a10", "l4", "a100-40", "a100-80", "h100-80", "h200"]


def test_the_table_has_each_card_by_what_it_offers():
    table = ckptlab.cards()
    assert [c.name for c in table] == NAMES and table == cards()
    assert all(isinstance(c, Card) and dataclasses.is_dataclass(c) for c in table)
    nominal = {"rtx3090": 24, "rtx4090": 24, "a10": 24, "l4": 24, "a100-40": 40, "a100-80": 80, "h100-80": 80,
               "h200": 141}
    for c in table:
        # every card offers less than its name's GiB, and more than 90% of it
        assert 0.9 * nominal[c.name] * GiB < c.usable_bytes < nominal[c.name] * GiB, c.name
        assert c.context_bytes == CONTEXT_BYTES_PER_SM * c.sm_count + KERNEL_IMAGES_BYTES
        assert c.required_margin_bytes == DEFAULT_MARGIN_BYTES
        assert c.budget_bytes == c.usable_bytes - c.context_bytes - DEFAULT_MARGIN_BYTES
    caps = {c.name: c.compute_capability for c in table}
    assert caps["rtx3090"] == caps["a10"] == (8, 6) and caps["rtx4090"] == caps["l4"] == (8, 9)
    assert caps["a100-40"] == caps["a100-80"] == (8, 0) and caps["h100-80"] == caps["h200"] == (9, 0)
    assert card("h100-80").cublas_workspace_bytes == 32 * MiB > card("a100-80").cublas_workspace_bytes
    assert set(DEFAULT_CARDS) <= set(NAMES)


@pytest.mark.parametrize("bad", ["rtx5090", "", None, 24])
def test_a_bad_card_name_is_one_line_listing_the_names(bad):
    with pytest.raises(ValueError) as info:
        card(bad)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"card={bad!r} is invalid: allowed are ")
    assert all(name in message for name in NAMES)


def test_a_capacity_is_a_card_or_a_size_and_either_can_be_adjusted():
    assert parse_capacity("RTX4090 ") is card("rtx4090")
    size = parse_capacity("24GiB")
    assert (size.name, size.usable_bytes, size.context_bytes, size.required_margin_bytes, size.arch) == (
        "24GiB", 24 * GiB, 0, 0, None)
    assert size.budget_bytes == 24 * GiB and parse_capacity(1000).name == "1KB"
    mine = parse_capacity("rtx4090", usable_bytes="23GiB", context_bytes="600MiB", required_margin_bytes=0)
    assert (mine.usable_bytes, mine.context_bytes, mine.required_margin_bytes, mine.arch) == (
        23 * GiB, 600 * MiB, 0, "sm89")
    assert parse_capacity(mine) is mine
    with pytest.raises(ValueError, match=r"^capacities='lots' is invalid: allowed is a card \(rtx3090, .*h200\) "
                                         r"or a positive size such as 24GiB"):
        parse_capacity("lots", "capacities")
    with pytest.raises(ValueError, match=r"usable_bytes=0 is invalid"):
        parse_capacity("rtx4090", usable_bytes=0)
    # text without a unit could be GB or GiB: refused, where a number from Python is bytes
    with pytest.raises(ValueError, match=r"^capacity='24' is invalid: a size needs its unit; allowed is a card "
                                         r"\(rtx3090, .*h200\) or a size such as 24GiB or 24GB$"):
        parse_capacity("24")
    assert parse_capacity(24 * GiB).usable_bytes == 24 * GiB


def test_fits_keeps_the_margin_and_margin_left_is_what_is_left_beyond_it():
    # margin_left = usable - required margin - device bytes, so it is >= 0 exactly when it fits:
    # at the edge (usable - 256 MiB of device bytes) 0 is left; one byte more is -1 and no fit.
    c = card("rtx4090")
    edge = c.usable_bytes - DEFAULT_MARGIN_BYTES
    assert fits(c, edge) and not fits(c, edge + 1)
    assert margin_left(c, edge) == 0 and margin_left(c, edge + 1) == -1
    assert fit_answer(c, edge, False) == "yes" and fit_answer(c, edge + 1, True) == "with cache flushes"
    assert fit_answer(c, edge + 1, False) == "no"
    size = parse_capacity("16MiB")   # a plain size keeps no margin
    assert fits(size, 16 * MiB) and not fits(size, 16 * MiB + 1)


def test_predict_fits_takes_card_names_and_shows_the_margin_left():
    workload = ckptlab.get_workload("gpt-tiny", n_layer=2)
    on_rtx = predict(workload, 1, 16, "full", device="cuda", card="rtx4090")
    peak = predict(workload, 1, 16, "full").peak_bytes
    # An RTX 4090 told it has that step's device bytes + its margin usable fits batch 1 with
    # exactly the margin left (and a larger batch only if the allocator reserves no more for it),
    # as a plain size of the CPU peak fits it with nothing left.
    exact = parse_capacity("rtx4090", usable_bytes=on_rtx.device_bytes + DEFAULT_MARGIN_BYTES)
    on_card, on_size = predict_fits(workload, ["full"], capacities=[exact, f"{peak}B"], seq_len=16, batch_size=1,
                                    dtype="fp32", max_batch=2, seq_lens=[16])
    assert predict(workload, 2, 16, "full").peak_bytes > peak
    assert on_card["capacity"] == "rtx4090" and on_size["capacity"] == f"{peak}B"
    assert on_size["max_batch_size"] == 1 and on_card["max_batch_size"] >= 1
    largest = predict(workload, on_card["max_batch_size"], 16, "full", device="cuda", card=exact)
    assert largest.device_bytes == on_rtx.device_bytes
    assert on_card["max_seq_len"] == on_size["max_seq_len"] == 16
    assert on_size["batch_margin_bytes"] == on_size["seq_margin_bytes"] == 0
    assert on_card["batch_margin_bytes"] == on_card["seq_margin_bytes"] == 0
    with pytest.raises(ValueError, match=r"capacities='rtx5090' is invalid: allowed is a card \(rtx3090"):
        predict_fits(workload, ["full"], capacities=["rtx5090"])


def test_fits_on_the_command_line_prints_predict_fits_rows(capsys):
    args = ["fits", "--model", "gpt-tiny", "--set", "n_layer=2", "--seq", "16", "--policy", "full",
            "--cards", "20MiB"]
    assert cli_main(args + ["--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = predict_fits(ckptlab.get_workload("gpt-tiny", n_layer=2), ["full"], ["20MiB"],
                            seq_len=16, batch_size=1, dtype="fp32")
    assert rows == json.loads(json.dumps(expected, default=str))
    assert cli_main(args) == 0
    table = capsys.readouterr().out
    assert "largest batch" in table and "20MiB" in table and "up to the model's 256 positions" in table
    assert cli_main(["fits", "--cards", "rtx5090"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cards rtx5090 is invalid: allowed is a card (rtx3090")
    assert cli_main(["fits", "--cards", "rtx4090,,h200"]) == 2   # an empty item is refused, not dropped
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --cards 'rtx4090,,h200' is invalid: allowed is a comma-separated list of cards or sizes, "
                   "none empty"]


def test_fits_by_default_searches_at_the_models_longest_sequence_and_says_where_its_search_stops(capsys):
    # gpt-tiny takes 256 positions, fewer than fits' 2048: the batch search runs at 256; on 1 GiB
    # a 2-layer gpt-tiny at seq 16 fits more than the 4 batches searched, so the table says "4 or more"
    assert cli_main(["fits", "--set", "n_layer=2", "--policy", "full", "--cards", "1GiB"]) == 0
    table = capsys.readouterr().out
    assert "the largest batch at seq 256 (the model's longest)" in table
    rows = predict_fits(ckptlab.get_workload("gpt-tiny", n_layer=2), ["full"], ["1GiB"], seq_len=16, dtype="fp32",
                        max_batch=4)
    assert rows[0]["max_batch_size"] == rows[0]["max_batch_searched"] == 4
    assert or_more(rows[0], "max_batch_size") == "4 or more" and or_more(dict(rows[0], max_batch_size=3),
                                                                          "max_batch_size") == 3


def test_notebook_parameters_and_the_command_line_take_card_names(capsys):
    checks = _value_checks()
    checks["capacity"]("capacity", "h100-80")
    checks["fits_capacities"]("fits_capacities", ["rtx4090", "24GiB"])
    with pytest.raises(ValueError, match=r"fits_capacities='rtx5090' is invalid"):
        checks["fits_capacities"]("fits_capacities", ["rtx4090", "rtx5090"])
    assert cli_main(["cards"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES) and "RTX 4090" in out and "23.6 GiB" in out
    assert cli_main(["explain", "--model", "gpt-tiny", "--capacity", "rtx5090"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --capacity rtx5090 is invalid: allowed is a card (rtx3090")


def test_lora_fits_takes_card_names_and_says_the_margin_at_the_longest_sequence():
    table = lora_fits("hf-llama-tiny", 4, [16], ["h200", "1KiB"], ["none"], dtype="fp32")
    h200 = card("h200")
    on_h200 = predict("hf-llama-tiny+lora=4", 1, 16, "none", dtype="fp32", device="cuda", card="h200")
    assert bool(table["fits_h200"].iloc[0]) and not bool(table["fits_1KiB"].iloc[0])
    assert table["device_h200_bytes"].iloc[0] == on_h200.device_bytes   # predicted for the card
    assert table["margin_h200_bytes"].iloc[0] == (h200.usable_bytes - h200.required_margin_bytes
                                                     - on_h200.device_bytes) == on_h200.margin_bytes
    longest = longest_fitting(table).set_index("capacity")
    assert longest.loc["h200", "longest_seq_len"] == 16 and longest.loc["1KiB", "longest_seq_len"] == 0
    assert longest.loc["h200", "margin_bytes"] == table["margin_h200_bytes"].iloc[0]
    assert longest.loc["1KiB", "margin_bytes"] is None or pd.isna(longest.loc["1KiB", "margin_bytes"])
    assert table["fit_h200"].iloc[0] == on_h200.fit == "yes" and "fit_1KiB" not in table
    assert longest.loc["h200", "longest_seq_len_with_flushes"] == 16
    assert pd.isna(longest.loc["1KiB", "longest_seq_len_with_flushes"])


def test_lora_fits_in_worker_processes_answers_the_same_rows():
    """Two policies in two spawned processes: the same table, rows in the order asked."""
    options = dict(capacities=["h200", "1KiB"], policies=["full", "none"], dtype="fp32")
    here = lora_fits("hf-llama-tiny", 4, [16], **options)
    pd.testing.assert_frame_equal(lora_fits("hf-llama-tiny", 4, [16], **options, workers=2), here)
    assert list(here["policy"]) == ["full", "none"]
    with pytest.raises(ValueError, match="workers=0 is invalid"):
        lora_fits("hf-llama-tiny", 4, [16], **options, workers=0)
