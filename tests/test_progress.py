"""Progress bars show on a terminal only: piped, a long run prints nothing but its results."""

import io

from ckptlab.run.progress import Progress, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_writes_to_a_terminal_and_nothing_when_piped(monkeypatch):
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stream)
        progress = Progress("compare tiny")
        progress.phase("time 3 configurations together", None, "round")
        progress.step("widest interval ±4.0% (target ±2%)")
        progress.close()
        text = stream.getvalue()
        assert ("compare tiny: time 3 configurations together" in text and "±4.0%" in text) == shown, text
        assert (text == "") == (not shown)


def test_a_bar_switched_off_stays_off_on_a_terminal(monkeypatch):
    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    bar = progress_bar(3, "sweep gpt-tiny", "cell", enabled=False)
    bar.update(3)
    bar.close()
    assert stream.getvalue() == ""


def test_explain_counts_its_stages_on_a_terminal(monkeypatch):
    from ckptlab.report.explain import explain

    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    explain("gpt-tiny", 1, 8, "none")
    text = stream.getvalue()
    assert "explain: stages" in text and "6/6" in text and "the waterfall" in text, text
