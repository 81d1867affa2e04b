"""The built documentation site in a real browser (opt-in: `make test-browser`).

Builds the site (`mkdocs build --strict`, as `make docs` does) into a temporary folder, serves it
on 127.0.0.1 from this process, opens the page of notebook 02 (the executed density sweep) in
Debian's headless Chromium and checks that the page shows the notebook's cells and its figure,
decoded, with no request leaving the machine. A screenshot goes to
results/browser-check/docs-02_density_sweep.png.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from .chromium import FLAGS, ensure_chromium

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "browser-check"
PAGE = "results/02_density_sweep/default/02_density_sweep/"
FIGURE = "memory_time_vs_density"

# Every <img> of the page's content decoded and painted with a real size.
FIGURES_SHOWN = """() => {
  const imgs = [...document.querySelectorAll('article img')];
  return Promise.all(imgs.map(i => i.decode().catch(() => null))).then(() =>
    imgs.filter(i => i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().width > 0)
        .map(i => i.getAttribute('src')));
}"""


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build_site(site: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(site.parent)})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"


def test_notebook_page_shows_its_figure_in_browser():
    from playwright.sync_api import sync_playwright

    chromium = ensure_chromium()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckptlab-docs-") as tmp:
        site = Path(tmp) / "site"
        build_site(site)
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_port}/"
        outside: list[str] = []
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.on("request", lambda r: r.url.startswith(("http:", "https:")) and not r.url.startswith(base)
                        and outside.append(r.url))
                page.goto(base + PAGE, timeout=60_000)
                page.locator("article .jp-Cell").first.wait_for(timeout=30_000)
                shown = page.evaluate(FIGURES_SHOWN)
                # the executed notebook embeds its figure; a run without embedded images shows the run's PNG
                figure = next((src for src in shown if FIGURE in src or src.startswith("data:image/png")), None)
                assert figure, f"figure {FIGURE} not shown; images shown: {[s[:80] for s in shown]}"
                assert page.locator("article .jp-OutputArea table").count() >= 1, "the overhead table is missing"
                page.locator("article img").first.scroll_into_view_if_needed()
                page.screenshot(path=str(OUT / "docs-02_density_sweep.png"))
                browser.close()
        finally:
            server.shutdown()
            server.server_close()
    assert not outside, f"the page requested resources from outside the machine: {outside}"
