"""The interactive explorer: pick a model, batch, sequence length, policy and memory limit; see
peak memory (by category) and step time for that policy next to no checkpointing, and beside the
measurement the explanation of that peak (`ckptlab.explain`: its cause, the checkpoint floor and
the levers that would lower it, predicted).

    Explorer().show()                    # JupyterLab: widgets; a change re-measures
    Explorer().show(interactive=False)   # papermill / static: the same views, rendered once

Every view is a real measurement of the chosen configuration, timed together with no
checkpointing (interleaved rounds, `ckptlab.probe.timing`): step times and the overhead carry their
95% intervals. Sliders use
`continuous_update=False`, so a drag measures once, on release; Run measures again (after
editing the memory limit, or to re-time). The callbacks are plain methods, tested without a
browser.
"""

from __future__ import annotations

from typing import Optional, Union

import matplotlib.pyplot as plt
import pandas as pd

from ..core.policy import parse_policy
from ..core.units import format_bytes, parse_bytes
from ..plan.budget import measure
from ..probe.timing import check_timing_options
from ..report.explain import Explanation, explain
from ..report.plots import peak_breakdown
from ..run.compare import measure_together
from ..workloads.base import Workload
from ..workloads.models import PRESETS
from ..workloads.registry import get_workload

# Offered in the model box; any other spec can be typed there (hf:qwen2, path/to/file.py:factory).
MODEL_CHOICES = (*PRESETS, "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny", "hf:qwen2", "hf:t5", "hf:vit")
POLICY_CHOICES = ("none", "density", "every=2", "segments=sqrt", "full")  # "density" uses the slider
BATCHES = [1, 2, 4, 8, 16, 32, 64]
SEQS = [16, 32, 64, 128, 256, 512, 1024]


class Explorer:
    def __init__(self, model: Union[str, Workload] = "gpt-tiny", batch_size: int = 4, seq_len: int = 64,
                 policy: str = "density=0.5", memory_limit: Optional[str] = None,
                 device: str = "cpu", steps: int = 2, warmup: int = 1, max_seconds: float = 5.0,
                 with_explanation: bool = True):
        parse_policy(policy)
        parse_bytes(memory_limit)
        check_timing_options(0.02, max_seconds)
        self.workload = _workload(model)
        self.config = dict(model=model if isinstance(model, str) else self.workload.label, batch_size=batch_size,
                           seq_len=seq_len, policy=policy, memory_limit=memory_limit, device=device, steps=steps,
                           warmup=warmup, max_seconds=max_seconds)
        self.records: Optional[pd.DataFrame] = None
        self.explanation: Optional[Explanation] = None
        self.with_explanation = with_explanation   # seconds of predictions per change: off for quick tests
        self._widgets = None

    # ------------------------------------------------------------------ the model of the view
    def set(self, **changes) -> None:
        """Change the configuration (validated: a bad value raises and changes nothing)."""
        new = {**self.config, **changes}
        parse_policy(new["policy"])
        parse_bytes(new["memory_limit"])
        workload = self.workload
        if "model" in changes:
            workload = _workload(new["model"])
            new["model"] = workload.label if isinstance(new["model"], Workload) else new["model"]
        self.workload, self.config = workload, new

    def run(self) -> pd.DataFrame:
        """Measure the chosen policy and the no-checkpointing baseline, timed together (paired
        rounds, `ckptlab.probe.timing`); returns both rows."""
        c = self.config
        policies = list(dict.fromkeys(["none", str(parse_policy(c["policy"]))]))
        if len(policies) == 1:
            rows = [measure(self.workload, c["batch_size"], c["seq_len"], "none", device=c["device"],
                            steps=c["steps"], warmup=c["warmup"], memory_limit=c["memory_limit"],
                            max_seconds=c["max_seconds"])]
        else:
            rows = measure_together(self.workload, c["batch_size"], c["seq_len"], policies,
                                    device=c["device"], memory_limit_bytes=parse_bytes(c["memory_limit"]),
                                    steps=c["steps"], warmup=c["warmup"], max_seconds=c["max_seconds"])
        self.records = pd.DataFrame(rows)
        if self.with_explanation:
            self.explanation = explain(self.workload, c["batch_size"], c["seq_len"], c["policy"],
                                       capacity=c["memory_limit"])
        return self.records

    def summary(self) -> str:
        """One line per measured policy: peak, step time, overhead, fits."""
        if self.records is None:
            return "not measured yet"
        df = self.records
        base = df.iloc[0]
        lines = [f"{self.config['model']}  batch {self.config['batch_size']} x seq {self.config['seq_len']}"
                 f"  on {base['device_name']}"]
        for _, r in df.iterrows():
            if r["status"] != "ok" and r["status"] != "oom":
                lines.append(f"{r['policy']:>14}: {r['status']} — {r['message']}")
                continue
            ratio = r.get("time_ratio")
            overhead = "" if ratio is None or pd.isna(ratio) or r["policy"] == base["policy"] else (
                f"  overhead {ratio - 1:+.0%} [{r['time_ratio_low'] - 1:+.0%}, {r['time_ratio_high'] - 1:+.0%}]"
                + ("" if r["significant"] else " (not distinguishable from none)"))
            time = "not timed" if pd.isna(r["step_ms"]) else (
                f"{r['step_ms']:.1f} ms/step [{r['step_ms_low']:.1f}, {r['step_ms_high']:.1f}]")
            fits = "" if r["fits"] is None or pd.isna(r["fits"]) else ("  fits" if r["fits"] else "  DOES NOT FIT")
            lines.append(f"{r['policy']:>14}: peak {format_bytes(r['peak_bytes'])}, "
                         f"held for backward {format_bytes(r['saved_activation_bytes'])}, {time}{overhead}{fits}")
        timed = df[df["rounds"].notna()] if "rounds" in df else df.iloc[:0]
        if len(timed):
            t = timed.iloc[0]
            lines.append(f"{int(t['rounds'])} interleaved rounds, 95% intervals in brackets, {int(t['threads'])} "
                         f"threads, load {t['load_before']:.1f} -> {t['load_after']:.1f}"
                         + ("  BUSY MACHINE: rerun before trusting the times" if t["busy"] else ""))
        e = self.explanation
        if e is not None:
            lines.append(f"why ({e.policy}, predicted peak {format_bytes(e.peak_bytes)} {e.peak_phase}): {e.cause}")
            lines.append(f"  lowest peak of any checkpoint policy: {format_bytes(e.checkpoint_floor_bytes)} "
                         f"({e.checkpoint_floor_policy})")
            for lever in [lv for lv in e.levers if lv.predicted_peak_bytes is not None][:3]:
                lines.append(f"  {lever.name}: {format_bytes(lever.predicted_peak_bytes)}"
                             + ("" if lever.basis == "predicted" else f" ({lever.basis})"))
        return "\n".join(lines)

    def figure(self):
        limit = parse_bytes(self.config["memory_limit"])
        return peak_breakdown(self.records if self.records is not None else pd.DataFrame(), limit_bytes=limit)

    # ------------------------------------------------------------------ widgets
    def on_change(self, name: str, value) -> None:
        """A control changed: update the configuration, then measure and redraw. A bad value
        (a model spec that does not load, a limit that does not parse) is shown in the output
        area and changes nothing."""
        try:
            if name in ("policy_choice", "density"):
                choice = self._widgets["policy_choice"].value
                self.set(policy=f"density={self._widgets['density'].value:g}" if choice == "density" else choice)
            elif name == "memory_limit":
                self.set(memory_limit=value.strip() or None)
            elif name == "model":
                self.set(model=value.strip())
            else:
                self.set(**{name: value})
        except ValueError as exc:
            out = self._widgets["output"]
            out.clear_output(wait=True)
            with out:
                print(f"error: {exc}")
            return
        self.refresh()

    def refresh(self) -> None:
        """Measure and redraw into the output area (the Run button and every change end here)."""
        from IPython.display import display  # noqa: PLC0415 - IPython comes with the notebooks extra

        out = self._widgets["output"]
        out.clear_output(wait=True)
        with out:
            try:
                self.run()
                print(self.summary())
                fig = self.figure()
                display(fig)
                plt.close(fig)
            except ValueError as exc:
                print(f"error: {exc}")

    def widgets(self):
        import ipywidgets as w  # noqa: PLC0415 - ipywidgets comes with the notebooks extra

        c = self.config
        kind, _, value = c["policy"].partition("=")
        choices = list(dict.fromkeys(POLICY_CHOICES + (c["policy"] if kind != "density" else "density",)))
        controls = dict(
            model=w.Combobox(options=list(dict.fromkeys((*MODEL_CHOICES, c["model"]))), value=c["model"],
                             description="model", placeholder="preset, hf:<type> or file.py:factory",
                             ensure_option=False, continuous_update=False),
            batch_size=w.SelectionSlider(options=BATCHES, value=c["batch_size"], description="batch",
                                         continuous_update=False),
            seq_len=w.SelectionSlider(options=SEQS, value=c["seq_len"], description="seq",
                                      continuous_update=False),
            policy_choice=w.Dropdown(options=choices, value="density" if kind == "density" else c["policy"],
                                     description="policy"),
            density=w.FloatSlider(value=float(value) if kind == "density" else 0.5, min=0, max=1, step=0.125,
                                  description="density", continuous_update=False),
            memory_limit=w.Text(value=c["memory_limit"] or "", description="limit", placeholder="e.g. 40MiB",
                                continuous_update=False),
        )
        for name, control in controls.items():
            control.observe(lambda change, name=name: self.on_change(name, change["new"]), names="value")
        button = w.Button(description="Run", button_style="primary")
        button.on_click(lambda _: self.refresh())
        self._widgets = {**controls, "output": w.Output()}
        return w.VBox([w.HBox([controls["model"], controls["policy_choice"], controls["density"]]),
                       w.HBox([controls["batch_size"], controls["seq_len"]]),
                       w.HBox([controls["memory_limit"], button]), self._widgets["output"]])

    def show(self, interactive: bool = True) -> None:
        """Interactive: the widgets and a first measurement. Static: measure once and render the
        same summary and figure without widgets (papermill, nbval)."""
        from IPython.display import display  # noqa: PLC0415 - IPython comes with the notebooks extra

        if interactive:
            display(self.widgets())
            self.refresh()
            return

        self.run()
        print(self.summary())
        fig = self.figure()
        display(fig)
        plt.close(fig)


def _workload(model: Union[str, Workload]) -> Workload:
    return model if isinstance(model, Workload) else get_workload(model)
