"""The explorer's callbacks as plain functions (the browser test drives the real widgets)."""

import pytest

from ckptlab import get_workload
from ckptlab.apps.explorer import Explorer

SMALL = dict(batch_size=2, seq_len=16, steps=1, warmup=0, max_seconds=0.2)


def test_run_measures_the_policy_beside_no_checkpointing():
    explorer = Explorer(get_workload("gpt-tiny", n_layer=2), policy="full", **SMALL)
    df = explorer.run()
    assert list(df.policy) == ["none", "full"]
    assert df.saved_activation_bytes.iloc[1] < df.saved_activation_bytes.iloc[0]
    summary = explorer.summary()
    assert "gpt-tiny  batch 2 x seq 16" in summary and "overhead" in summary and "full: peak" in summary
    # beside the measurement, the explanation of the same step, its peak predicted to the byte
    assert explorer.explanation.peak_bytes == df.peak_bytes.iloc[1]
    assert "why (full, predicted peak" in summary and "lowest peak of any checkpoint policy" in summary


def test_memory_limit_marks_what_does_not_fit():
    # at this shape activations dominate: none peaks at 77.8 MiB, full at 31.0 MiB
    explorer = Explorer(policy="full", memory_limit="48MiB", batch_size=8, seq_len=128, steps=1, warmup=0, max_seconds=0.2,
                        with_explanation=False)
    explorer.run()
    lines = explorer.summary().splitlines()
    assert "DOES NOT FIT" in lines[1] and lines[2].rstrip().endswith("fits")


def test_set_validates_before_changing_anything():
    explorer = Explorer(**SMALL)
    with pytest.raises(ValueError, match="density=3 is invalid"):
        explorer.set(policy="density=3")
    with pytest.raises(ValueError, match="memory_limit='lots' is invalid"):
        explorer.set(memory_limit="lots")
    with pytest.raises(ValueError, match="model='gpt-9' is invalid"):
        explorer.set(model="gpt-9")
    assert explorer.config["policy"] == "density=0.5" and explorer.config["memory_limit"] is None


def test_widget_changes_reach_the_configuration_and_remeasure():
    explorer = Explorer(**SMALL, with_explanation=False)
    explorer.widgets()
    w = explorer._widgets
    w["batch_size"].value = 4                      # what a slider release sends
    assert explorer.config["batch_size"] == 4 and list(explorer.records.batch_size) == [4, 4]
    w["policy_choice"].value = "full"
    assert explorer.config["policy"] == "full" and list(explorer.records.policy) == ["none", "full"]
    w["policy_choice"].value = "density"
    w["density"].value = 0.25
    assert explorer.config["policy"] == "density=0.25"
    w["memory_limit"].value = "1GiB"
    assert explorer.config["memory_limit"] == "1GiB" and bool(explorer.records.fits.all())
    assert all(not control.continuous_update for name, control in w.items()
               if name in ("batch_size", "seq_len", "density"))


def test_static_view_renders_without_widgets(capsys):
    Explorer(policy="every=2", **SMALL, with_explanation=False).show(interactive=False)
    out = capsys.readouterr().out
    assert "every=2: peak" in out
