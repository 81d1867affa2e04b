"""The interactive explorer: pick a model, batch, sequence length, policy, dtype and training loop;
see the step's peak memory (by category) for that policy next to no checkpointing, measured here
or predicted for a GPU card.

    Explorer().show()                          # JupyterLab: widgets; a change re-measures
    Explorer().show(interactive=False)         # papermill / static: the same views, rendered once
    Explorer("hf-llama-7b+lora=16", card="rtx4090", dtype="bf16-weights").show()   # predicts

Without a card every view is a real measurement of the chosen configuration on `device`, timed
together with no checkpointing (interleaved rounds, `ckptlab.probe.timing`): step times and the
overhead carry their 95% intervals, and beside them the explanation of that peak
(`ckptlab.explain`: its cause, the checkpoint floor and the levers that would lower it).

With a card (a name of `ckptlab.cards()`, or a `core.cards.Card`) every change PREDICTS instead
(`ckptlab.predict(..., device="cuda", card=...)`, fake tensors, nothing allocated): for the policy
and for none, side by side, the device bytes, whether the step fits the card ("yes", "with cache
flushes", "no") and why, the margin left, allocated and reserved bytes, the attention backend, the
peak's phase and the prediction's own seconds. The predictions of a model reuse its prepared fake
model at other shapes (`estimate.fake_step.prepared_step`), and the explorer keeps its last
predictions, so a change costs at most the two predictions it shows; the explanation (many
predictions) is off unless `with_explanation=True`, and the largest batch that fits
(`ckptlab.predict_fits` for the card) is computed on request (`largest_batch`, the button).

Sliders use `continuous_update=False`, so a drag measures once, on release; Run (Predict) does it
again. The callbacks are plain methods, tested without a browser.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Union

import matplotlib.pyplot as plt
import pandas as pd

from ..core.cards import Card, cards, parse_capacity
from ..core.dtypes import DTYPES
from ..core.loop import DEFAULT_LOOP, as_loop
from ..core.policy import parse_policy
from ..core.units import format_bytes, parse_bytes
from ..core.validate import choice
from ..estimate.fake_step import Prediction
from ..estimate.predict import check_device, check_prediction, predict_fits
from ..plan.budget import measure, predict
from ..probe.timing import check_timing_options
from ..report.explain import Explanation, explain
from ..report.plots import peak_breakdown, prediction_breakdown
from ..run.compare import measure_together
from ..workloads.base import Workload
from ..workloads.models import PRESETS
from ..workloads.registry import get_workload

# Offered in the model box; any other spec can be typed there (hf:qwen2, path/to/file.py:factory).
MODEL_CHOICES = (*PRESETS, "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny", "hf:qwen2", "hf:t5", "hf:vit")
CARD_MODEL_CHOICES = (*MODEL_CHOICES, "hf-llama-1b", "hf-llama-7b", "hf-llama-7b+lora=16")   # predicted, not run
POLICY_CHOICES = ("none", "density", "every=2", "segments=sqrt", "full")  # "density" uses the slider
BATCHES = [1, 2, 4, 8, 16, 32, 64]
SEQS = [16, 32, 64, 128, 256, 512, 1024]          # measured here, on a CPU
CARD_SEQS = [2**k for k in range(7, 16)]          # predicted for a card: 128 .. 32768
PREDICTIONS_KEPT = 8   # the last predictions, by their arguments: a policy toggled back costs nothing


LARGEST_BATCH_SEARCHED = 1024   # the largest batch tried: an answer of this size means "this or more"


def _searched(batch: int) -> str:
    return f"{batch} or more (the search stops there)" if batch == LARGEST_BATCH_SEARCHED else str(batch)


class Explorer:
    def __init__(self, model: Union[str, Workload] = "gpt-tiny", batch_size: int = 4, seq_len: int = 64,
                 policy: str = "density=0.5", memory_limit: Optional[str] = None,
                 device: str = "cpu", steps: int = 2, warmup: int = 1, max_seconds: float = 5.0,
                 with_explanation: Optional[bool] = None, *, card: Union[str, Card, None] = None,
                 dtype: str = "fp32", loop: Optional[str] = None):
        """`card` chooses the view for good: None measures on `device` (`memory_limit`, `steps`,
        `warmup` and `max_seconds` are the measurement's); a card predicts for it. `loop` is the
        training loop's text (`ckptlab.Loop`: "adamw-fused,accum=2,holds-output"; None the
        default). `with_explanation` (None: on when measuring, off on a card) adds `explain`."""
        check_timing_options(0.02, max_seconds)
        config = dict(model=model, batch_size=batch_size, seq_len=seq_len, policy=policy, dtype=dtype,
                      loop=loop, card=card, memory_limit=memory_limit, device=device, steps=steps, warmup=warmup,
                      max_seconds=max_seconds)
        self.workload, self.config = _checked(config, None)
        self.records: Optional[pd.DataFrame] = None
        self.predictions: Optional[list[Prediction]] = None   # on a card: none's, then the policy's
        self.fits: Optional[list[dict]] = None                # on a card: `largest_batch`'s rows
        self.explanation: Optional[Explanation] = None
        self.with_explanation = card is None if with_explanation is None else with_explanation
        self._predicted: OrderedDict = OrderedDict()
        self._widgets = None

    @property
    def on_card(self) -> bool:
        """Whether the explorer predicts for a card (else it measures)."""
        return self.config["card"] is not None

    # ------------------------------------------------------------------ the model of the view
    def set(self, **changes) -> None:
        """Change the configuration (validated: a bad value raises and changes nothing). The view
        stays what it was made: a card for a card, no card for measuring."""
        unknown = sorted(set(changes) - set(self.config))
        if unknown:
            raise ValueError(f"{unknown[0]}={changes[unknown[0]]!r} is invalid: allowed are {', '.join(self.config)}")
        if "card" in changes and (changes["card"] is None) == self.on_card:
            raise ValueError(
                f"card={changes['card']!r} is invalid for an explorer that "
                + (f"predicts: allowed are {', '.join(c.name for c in cards())} (make one without a card to measure)"
                   if self.on_card else "measures: allowed is None (make one with card=... to predict for a card)"))
        workload, config = _checked({**self.config, **changes}, self.workload if "model" not in changes else None)
        if workload is not self.workload:
            self._predicted.clear()
        self.workload, self.config = workload, config

    def run(self) -> pd.DataFrame:
        """Measure, or on a card predict, the chosen policy and the no-checkpointing baseline;
        returns both rows (records of `measure`, or `Prediction.record()`s)."""
        c = self.config
        policies = self._policies()
        if self.on_card:
            self.predictions = [self._prediction(p) for p in policies]
            self.records = pd.DataFrame([p.record() for p in self.predictions])
            self.fits = None
        else:
            self.records = pd.DataFrame(self._measured(policies))
        if self.with_explanation:
            where = {"card": c["card"]} if self.on_card else {"capacity": c["memory_limit"]}
            self.explanation = explain(self.workload, c["batch_size"], c["seq_len"], c["policy"], dtype=c["dtype"],
                                       loop=c["loop"], **where)
        return self.records

    def _policies(self) -> list[str]:
        """What a view shows: none, then the chosen policy (once, where it is none)."""
        return list(dict.fromkeys(["none", str(parse_policy(self.config["policy"]))]))

    def _measured(self, policies: list[str]) -> list[dict]:
        """The records of the policies, measured here and timed together (paired rounds)."""
        c = self.config
        common = dict(device=c["device"], dtype=c["dtype"], loop=c["loop"], steps=c["steps"], warmup=c["warmup"],
                      max_seconds=c["max_seconds"])
        if len(policies) == 1:
            return [measure(self.workload, c["batch_size"], c["seq_len"], "none", memory_limit=c["memory_limit"],
                            **common)]
        return measure_together(self.workload, c["batch_size"], c["seq_len"], policies,
                                memory_limit_bytes=parse_bytes(c["memory_limit"]), **common)

    def _prediction(self, policy: str) -> Prediction:
        """`ckptlab.predict` for the card at the configuration, or the same prediction made before
        (the last PREDICTIONS_KEPT kept)."""
        c = self.config
        key = (c["batch_size"], c["seq_len"], policy, c["dtype"], c["loop"], c["card"])
        if key not in self._predicted:
            self._predicted[key] = predict(self.workload, c["batch_size"], c["seq_len"], policy, dtype=c["dtype"],
                                           loop=c["loop"], device="cuda", card=c["card"])
            while len(self._predicted) > PREDICTIONS_KEPT:
                self._predicted.popitem(last=False)
        self._predicted.move_to_end(key)
        return self._predicted[key]

    def largest_batch(self) -> list[dict]:
        """On a card: the largest batch of the policy and of none that fits it at this sequence
        length (`ckptlab.predict_fits` rows: `max_batch_size`, `max_batch_size_with_flushes`);
        shown in the summary until the next change. A search of several predictions each."""
        c = self.config
        if not self.on_card:
            raise ValueError("largest_batch is for an explorer with a card: allowed is Explorer(card=...)")
        self.fits = predict_fits(self.workload, self._policies(), [c["card"]], seq_len=c["seq_len"], seq_lens=[c["seq_len"]],
                                 dtype=c["dtype"], loop=c["loop"], max_batch=LARGEST_BATCH_SEARCHED)
        return self.fits

    # ------------------------------------------------------------------ what is shown
    def summary(self) -> str:
        """Measured: one line per policy (peak, step time, overhead, fits). On a card: the two
        predictions side by side, why each fits or not, and the largest batches if asked."""
        if self.records is None:
            return "not measured yet" if not self.on_card else "not predicted yet"
        lines = self._predicted_lines() if self.on_card else self._measured_lines()
        return "\n".join(lines + self._explanation_lines())

    def _measured_lines(self) -> list[str]:
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
        return lines

    def _predicted_lines(self) -> list[str]:
        c, card = self.config, parse_capacity(self.config["card"], "card")
        lines = [f"{c['model']}  batch {c['batch_size']} x seq {c['seq_len']}  {c['dtype']}, loop {c['loop']}"
                 f"  predicted for {card.describe()}", prediction_table(self.predictions).to_string()]
        lines += [f"{p.policy:>14}: {p.fit_reason}" for p in self.predictions]
        if self.fits is not None:
            lines.append(f"largest batch at seq {c['seq_len']} on {card.label}: " + ", ".join(
                f"{r['policy']} {_searched(r['max_batch_size'])} ({_searched(r['max_batch_size_with_flushes'])} with "
                "cache flushes)" for r in self.fits))
        return lines

    def _explanation_lines(self) -> list[str]:
        e = self.explanation
        if e is None or not self.with_explanation:
            return []
        peak = (f"predicted peak {format_bytes(e.peak_bytes)} {e.peak_phase}" if e.card is None else
                f"predicted device bytes {format_bytes(e.device_bytes)}, peak in {e.peak_phase}")   # the levers' sizes
        lines = [f"why ({e.policy}, {peak}): {e.cause}",
                 f"  lowest peak of any checkpoint policy: {format_bytes(e.checkpoint_floor_bytes)} "
                 f"({e.checkpoint_floor_policy})"]
        for lever in [lv for lv in e.levers if lv.predicted_peak_bytes is not None][:3]:
            lines.append(f"  {lever.name}: {format_bytes(lever.predicted_peak_bytes)}"
                         + ("" if lever.basis == "predicted" else f" ({lever.basis})"))
        return lines

    def figure(self):
        if self.on_card:
            return prediction_breakdown(self.predictions or [])
        limit = parse_bytes(self.config["memory_limit"])
        return peak_breakdown(self.records if self.records is not None else pd.DataFrame(), limit_bytes=limit)

    # ------------------------------------------------------------------ widgets
    def on_change(self, name: str, value) -> None:
        """A control changed: update the configuration, then measure (predict) and redraw. A bad
        value (a model spec that does not load, a limit or loop that does not parse) is shown in
        the output area and changes nothing."""
        try:
            if name in ("policy_choice", "density"):
                picked = self._widgets["policy_choice"].value
                self.set(policy=f"density={self._widgets['density'].value:g}" if picked == "density" else picked)
            elif name in ("memory_limit", "loop"):
                self.set(**{name: value.strip() or None})
            elif name == "model":
                self.set(model=value.strip())
            else:
                self.set(**{name: value})
        except ValueError as exc:
            message = f"error: {exc}"
            self._into_output(lambda: print(message))
            return
        self.refresh()

    def refresh(self) -> None:
        """Measure (predict) and redraw into the output area (the Run button and every change end here)."""
        self._into_output(lambda: (self.run(), self._draw()))

    def on_largest_batch(self) -> None:
        """The Largest batch button: search, then redraw with its line."""
        self._into_output(lambda: (self.largest_batch(), self._draw()))

    def _into_output(self, work) -> None:
        out = self._widgets["output"]
        out.clear_output(wait=True)
        with out:
            try:
                work()
            except ValueError as exc:
                print(f"error: {exc}")

    def _draw(self) -> None:
        from IPython.display import display  # noqa: PLC0415 - IPython comes with the notebooks extra

        print(self.summary())
        fig = self.figure()
        display(fig)
        plt.close(fig)

    def widgets(self):
        import ipywidgets as w  # noqa: PLC0415 - ipywidgets comes with the notebooks extra

        c = self.config
        kind, _, value = c["policy"].partition("=")
        choices = list(dict.fromkeys(POLICY_CHOICES + (c["policy"] if kind != "density" else "density",)))
        controls = dict(
            model=w.Combobox(options=list(dict.fromkeys((*(CARD_MODEL_CHOICES if self.on_card else MODEL_CHOICES),
                                                          c["model"]))), value=c["model"],
                             description="model", placeholder="preset, hf:<type> or file.py:factory",
                             ensure_option=False, continuous_update=False),
            batch_size=w.SelectionSlider(options=_with(BATCHES, c["batch_size"]), value=c["batch_size"],
                                         description="batch", continuous_update=False),
            seq_len=w.SelectionSlider(options=_with(CARD_SEQS if self.on_card else SEQS, c["seq_len"]),
                                      value=c["seq_len"], description="seq", continuous_update=False),
            policy_choice=w.Dropdown(options=choices, value="density" if kind == "density" else c["policy"],
                                     description="policy"),
            density=w.FloatSlider(value=float(value) if kind == "density" else 0.5, min=0, max=1, step=0.125,
                                  description="density", continuous_update=False),
            dtype=w.Dropdown(options=list(DTYPES), value=c["dtype"], description="dtype"),
            loop=w.Text(value=c["loop"], description="loop", placeholder="e.g. adamw-fused,accum=2,holds-output",
                        continuous_update=False),
        )
        if self.on_card:
            name = parse_capacity(c["card"], "card").name
            controls["card"] = w.Dropdown(options=list(dict.fromkeys([*(k.name for k in cards()), name])), value=name,
                                          description="card")
        else:
            controls["memory_limit"] = w.Text(value=c["memory_limit"] or "", description="limit",
                                              placeholder="e.g. 40MiB", continuous_update=False)
        for key, control in controls.items():
            control.observe(lambda change, key=key: self.on_change(key, change["new"]), names="value")
        run = w.Button(description="Predict" if self.on_card else "Run", button_style="primary")
        run.on_click(lambda _: self.refresh())
        last_row = [controls["card"] if self.on_card else controls["memory_limit"], run]
        if self.on_card:
            largest = w.Button(description="Largest batch", tooltip="the largest batch that fits the card (slower)")
            largest.on_click(lambda _: self.on_largest_batch())
            last_row.append(largest)
        self._widgets = {**controls, "output": w.Output()}
        return w.VBox([w.HBox([controls["model"], controls["policy_choice"], controls["density"]]),
                       w.HBox([controls["batch_size"], controls["seq_len"]]),
                       w.HBox([controls["dtype"], controls["loop"]]),
                       w.HBox(last_row), self._widgets["output"]])

    def show(self, interactive: bool = True) -> None:
        """Interactive: the widgets and a first measurement (prediction). Static: once, the same
        summary and figure without widgets (papermill, nbval)."""
        if interactive:
            from IPython.display import display  # noqa: PLC0415 - IPython comes with the notebooks extra

            display(self.widgets())
            self.refresh()
            return
        self.run()
        self._draw()


def prediction_table(predictions: list[Prediction]) -> pd.DataFrame:
    """Predictions for one card side by side: one column per policy, one row per quantity."""
    return pd.DataFrame({p.policy: {
        "device bytes": format_bytes(p.device_bytes),
        "fits": p.fit + (f" ({p.cache_flushes}/step)" if p.cache_flushes else ""),
        "margin left": format_bytes(p.margin_bytes),
        "allocated / reserved": f"{format_bytes(p.peak_bytes)} / {format_bytes(p.reserved_bytes)}",
        "attention": p.attention_backend or "-",
        "peak in": p.peak_phase,
        "predicted in": f"{p.predict_s:.2f} s" + (" (kept on disk)" if p.answered_from_cache else ""),
    } for p in predictions})


def _checked(config: dict, workload: Optional[Workload]) -> tuple[Workload, dict]:
    """(the workload, the configuration as kept) of a new configuration, every value checked
    first, the cheapest first (ValueError naming the first bad one). `workload` is the one the
    model already loaded (None: load it, after the other checks)."""
    c = dict(config)
    policy = parse_policy(c["policy"])
    choice("dtype", c["dtype"], list(DTYPES))
    loop = as_loop(c["loop"] or DEFAULT_LOOP)
    loop.check_dtype(c["dtype"])
    c["loop"] = str(loop)
    parse_bytes(c["memory_limit"])
    if c["card"] is not None:
        check_device("cuda", c["card"])
        c["card"] = parse_capacity(c["card"], "card").name if isinstance(c["card"], str) else c["card"]
        if c["memory_limit"] is not None:
            raise ValueError(f"memory_limit={c['memory_limit']!r} is invalid with card={c['card']!r}: the card is the "
                             "limit; allowed is None")
    if workload is None:
        workload = _workload(c["model"])
        c["model"] = workload.label if isinstance(c["model"], Workload) else c["model"]
    if c["card"] is not None:
        check_prediction(workload, c["batch_size"], c["seq_len"], policy, c["dtype"], loop, "cuda", c["card"])
    return workload, c


def _with(options: list, value) -> list:
    """A slider's options with its value among them, in order."""
    return sorted({*options, value})


def _workload(model: Union[str, Workload]) -> Workload:
    return model if isinstance(model, Workload) else get_workload(model)
