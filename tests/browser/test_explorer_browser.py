"""The explorer in a real browser: JupyterLab + headless Chromium (opt-in: `make test-browser`).

Starts `jupyter lab` (this venv, 127.0.0.1, a free port, a token, a temporary runtime/config
dir) on a copy of `notebooks/06_explorer.ipynb`, opens it in Debian's Chromium driven by
Playwright, runs all cells from the Run menu, waits for the explorer's widgets and its first
measurement, moves the `batch` slider with the keyboard (one step right: 4 -> 8) and changes the
policy dropdown to `full`, and asserts the output re-measured each time. Screenshots and
`report.json` go to `results/browser-check/`. Every wait is bounded (BUDGET_S in all, after
Chromium is installed); Jupyter is shut down on pass and on failure.

Deselected from `make test` by the `browser` marker (pyproject `addopts = -m "not browser"`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest

from .chromium import FLAGS, chromium_version, ensure_chromium

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_explorer.ipynb"
OUT = ROOT / "results" / "browser-check"
BUDGET_S = 180  # everything after Chromium is installed: Jupyter up, notebook run, two re-measures
FIRST = re.compile(r"gpt-tiny\s+batch 4 x seq 64\s+on \S.*\n(?:.*\n)*.*peak .* ms/step")
AFTER_SLIDER = re.compile(r"gpt-tiny\s+batch 8 x seq 64\s+on \S.*\n(?:.*\n)*.*peak .* ms/step")
AFTER_POLICY = re.compile(r"batch 8 x seq 64[^\n]*\n(?:.*\n)*\s*full: peak .* ms/step")


KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""


# The figure is drawn: every <img> in the output decoded, then two frames painted.
FIGURE_READY = """async (el) => {
  const imgs = [...el.querySelectorAll('img')];
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);
}"""


class Deadline:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left_ms(self, cap_s: float | None = None) -> float:
        left = max(self.end - time.monotonic(), 0.5)
        return 1000 * (min(left, cap_s) if cap_s else left)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.start, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` in its own process group, serving `root_dir`; shut down on exit."""

    def __init__(self, root_dir: Path, tmp: Path):
        self.port, self.token = free_port(), secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "jupyter.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "MPLBACKEND"))}
        for name, sub in [("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_CONFIG_DIR", "config"),
                          ("JUPYTER_DATA_DIR", "data"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                          ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython")]:
            (tmp / sub).mkdir()
            env[name] = str(tmp / sub)
        self.cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                    "--ip=127.0.0.1", f"--port={self.port}", "--port-retries=0",
                    f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root_dir}",
                    "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                    "--LabApp.expose_app_in_browser=True"]
        # User settings: never ask about (or fetch) Jupyter news; no toasts over the screenshots.
        notes = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        notes.mkdir(parents=True)
        (notes / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))
        self.env = env
        self.proc = None
        self.shutdown = None

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self, deadline: Deadline) -> None:
        while time.monotonic() < deadline.end:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"jupyter lab did not answer on {self.base} in time:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(line.replace(self.token, "<token>") for line in lines)

    def __exit__(self, *exc) -> None:
        """POST /api/shutdown (stops kernels too); then SIGTERM, then SIGKILL, to the group."""
        try:
            req = urllib.request.Request(f"{self.base}/api/shutdown", method="POST", data=b"",
                                         headers={"Authorization": f"token {self.token}"})
            urllib.request.urlopen(req, timeout=10).close()
            self.proc.wait(timeout=30)
            self.shutdown = "api/shutdown"
        except Exception:
            for sig, how in ((signal.SIGTERM, "SIGTERM"), (signal.SIGKILL, "SIGKILL")):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=15)
                    self.shutdown = how
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        # Kernels the server started share its process group: make sure none is left behind.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


def output_text(page) -> str:
    return page.locator(".widget-output").first.inner_text(timeout=5000)


def wait_output(page, pattern: re.Pattern, deadline: Deadline, what: str) -> str:
    """Poll the explorer's Output widget until `pattern` matches and a figure is shown."""
    text = ""
    while time.monotonic() < deadline.end:
        try:
            text = output_text(page)
            if pattern.search(text) and page.locator(".widget-output").first.evaluate(FIGURE_READY):
                return text
        except Exception:  # the output area is redrawn (clear_output(wait=True)) while we read
            pass
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out waiting for {what}; explorer output was:\n{text or '(empty)'}")


def screenshot(page, name: str) -> str:
    page.locator(".widget-vbox").first.evaluate("e => e.closest('.jp-Cell').scrollIntoView({block: 'start'})")
    page.locator(".widget-output").first.evaluate(FIGURE_READY)
    page.wait_for_timeout(500)
    page.screenshot(path=str(OUT / name))
    return f"results/browser-check/{name}"


def run_all_cells(page, deadline: Deadline) -> str:
    """Run > Run All Cells from the menu bar, as a user would; the command registry as a fallback."""
    try:
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=deadline.left_ms(15))
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click(timeout=deadline.left_ms(10))
        return "menu Run > Run All Cells"
    except Exception:
        page.keyboard.press("Escape")
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        return "command notebook:run-all-cells (menu click failed)"


def drive(page, lab: JupyterLab, deadline: Deadline, report: dict) -> None:
    t, checks = report["timings_s"], report["assertions"]

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"check": name, "passed": bool(ok), **({"detail": detail} if detail else {})})
        assert ok, f"{name}: {detail}"

    page.goto(f"{lab.base}/lab/tree/{NOTEBOOK.name}?token={lab.token}", timeout=deadline.left_ms(60))
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=deadline.left_ms(90))
    # Run All before the session has a kernel opens a "Select Kernel" dialog: wait until the
    # notebook's kernel is connected and idle (the app is exposed by expose_app_in_browser).
    page.wait_for_function(KERNEL_IDLE, timeout=deadline.left_ms(90), polling=250)
    t["kernel_idle"] = deadline.elapsed()
    report["run_all_via"] = run_all_cells(page, deadline)
    select = page.locator(".jp-Dialog button.jp-mod-accept", has_text="Select")
    try:  # should not happen after KERNEL_IDLE; accept the default (python3) kernel if it does
        select.click(timeout=2000)
        report["kernel_dialog"] = "accepted"
    except Exception:
        pass

    page.locator(".widget-output").first.wait_for(timeout=deadline.left_ms())
    sliders = page.locator(".widget-hslider")
    t["widgets_shown"] = deadline.elapsed()
    labels = [s.inner_text() for s in page.locator(".widget-inline-hbox .widget-label").all()]
    check("explorer widgets render (model, policy, density, batch, seq, limit, Run)",
          all(x in labels for x in ("model", "policy", "density", "batch", "seq", "limit"))
          and page.locator("button.widget-button", has_text="Run").count() == 1, f"labels {labels}")

    before = wait_output(page, FIRST, deadline, "the first measurement (batch 4 x seq 64 ... ms/step)")
    t["first_measurement"] = deadline.elapsed()
    check("first measurement shown with a figure", True, before.splitlines()[0])
    report["screenshots"].append(screenshot(page, "before.png"))
    report["output_before"] = before.splitlines()

    # The batch SelectionSlider: focus its noUiSlider handle, one ArrowRight (4 -> 8); with
    # continuous_update=False the change reaches the kernel on the keyboard 'change' event.
    # the first explorer's (the measuring one; the notebook's second predicts for a card)
    batch = sliders.filter(has=page.locator("label.widget-label", has_text=re.compile(r"^batch$"))).first
    handle = batch.locator(".noUi-handle")
    handle.focus(timeout=deadline.left_ms(10))
    page.keyboard.press("ArrowRight")
    readout = batch.locator(".widget-readout").inner_text(timeout=5000)
    check("batch slider moved by keyboard (readout 4 -> 8)", readout.strip() == "8", f"readout {readout!r}")
    after = wait_output(page, AFTER_SLIDER, deadline, "the re-measurement at batch 8")
    t["after_slider"] = deadline.elapsed()
    check("output changed after the slider: 'batch 8 x seq 64' and new peaks",
          after != before and "batch 4 x seq" not in after, after.splitlines()[0])
    report["screenshots"].append(screenshot(page, "after.png"))
    report["output_after_slider"] = after.splitlines()

    policy = page.locator(".widget-dropdown").filter(
        has=page.locator("label.widget-label", has_text=re.compile(r"^policy$"))).first.locator("select")
    policy.select_option("full", timeout=deadline.left_ms(10))
    final = wait_output(page, AFTER_POLICY, deadline, "the re-measurement with policy full")
    t["after_policy"] = deadline.elapsed()
    check("output changed after the policy dropdown: a 'full' row at batch 8",
          "density=0.5:" not in final, " | ".join(line.strip() for line in final.splitlines()[1:]))
    report["screenshots"].append(screenshot(page, "after-policy.png"))
    report["output_after_policy"] = final.splitlines()


def test_explorer_in_browser():
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    for old in ("before.png", "after.png", "after-policy.png", "failure.png", "report.json"):
        (OUT / old).unlink(missing_ok=True)
    started = time.monotonic()
    report = {"test": "tests/browser/test_explorer_browser.py", "notebook": "notebooks/06_explorer.ipynb",
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"python": platform.python_version(),
                           **{p: version(p) for p in ("jupyterlab", "jupyter_server", "ipywidgets",
                                                      "jupyterlab_widgets", "ipykernel", "playwright")}},
              "budget_s": BUDGET_S, "timings_s": {}, "assertions": [], "screenshots": [], "outcome": "fail"}
    console_errors: list[str] = []
    lab = None
    try:
        chromium = ensure_chromium()
        report["versions"]["chromium"] = chromium_version(chromium)
        report["timings_s"]["chromium_ready"] = round(time.monotonic() - started, 1)
        deadline = Deadline(BUDGET_S)
        with tempfile.TemporaryDirectory(prefix="ckptlab-browser-") as tmp:
            tmp = Path(tmp)
            (tmp / "nb").mkdir()
            # A copy: JupyterLab autosaves what it runs, and the committed notebook stays clean.
            shutil.copy(NOTEBOOK, tmp / "nb" / NOTEBOOK.name)
            with JupyterLab(tmp / "nb", tmp) as lab:
                lab.wait_ready(deadline)
                report["timings_s"]["jupyter_up"] = deadline.elapsed()
                with sync_playwright() as pw:
                    context = pw.chromium.launch_persistent_context(
                        str(tmp / "chromium-profile"), executable_path=chromium, headless=True,
                        args=FLAGS, viewport={"width": 1280, "height": 1000})
                    page = context.pages[0] if context.pages else context.new_page()
                    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text[:300]))
                    report["versions"]["chromium_via_cdp"] = context.browser.version if context.browser else None
                    try:
                        drive(page, lab, deadline, report)
                    except BaseException:
                        try:
                            page.screenshot(path=str(OUT / "failure.png"))
                            report["screenshots"].append("results/browser-check/failure.png")
                        except Exception:
                            pass
                        print("--- jupyter log tail ---\n" + lab.log_tail(), file=sys.stderr)
                        raise
                    finally:
                        context.close()
        report["outcome"] = "pass"
    except BaseException as exc:
        report["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise
    finally:
        report["jupyter_shutdown"] = lab.shutdown if lab else None
        report["browser_console_errors"] = console_errors[:20]
        report["timings_s"]["total"] = round(time.monotonic() - started, 1)
        (OUT / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"browser check: {report['outcome']} in {report['timings_s']['total']} s; "
              f"report: results/browser-check/report.json", file=sys.stderr)
