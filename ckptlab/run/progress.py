"""Progress of a long run, on a terminal only: one line saying which phase runs and how far it is.

Every long run of ckptlab (a sweep's cells, a comparison's configurations, its timing rounds and
gradient checks, the frontier benchmark) shows its progress through `progress_bar`, and nowhere
else. tqdm's `disable=None` turns the bar off when stderr is not a terminal, so piped output, a
log file, a test or a notebook under papermill stay quiet.
"""

from __future__ import annotations

from typing import Optional


def progress_bar(total: Optional[int], desc: str, unit: str, enabled: bool = True):
    """A tqdm bar shown only when `enabled` and stderr is a terminal."""
    from tqdm.auto import tqdm  # noqa: PLC0415 - tqdm is not torch's dependency: `import ckptlab` needs only torch
    return tqdm(total=total, desc=desc, unit=unit, disable=None if enabled else True, dynamic_ncols=True)


class Progress:
    """One bar at a time for a run of several phases (build, time, verify): `phase` closes the
    previous bar and opens the next; `step` advances it, naming what was done."""

    def __init__(self, name: str, enabled: bool = True):
        self.name, self.enabled, self.bar = name, enabled, None

    def phase(self, what: str, total: Optional[int], unit: str) -> None:
        self.close()
        self.bar = progress_bar(total, f"{self.name}: {what}", unit, self.enabled)

    def step(self, note: str = "", n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


__all__ = ["Progress", "progress_bar"]
