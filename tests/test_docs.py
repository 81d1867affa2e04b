"""The documentation site builds in strict mode (`make docs`), with every page, every notebook's
figure and the API reference, and reads offline.

The site is built once for the module (about 10-20 s on 2 cores: eight notebooks converted and the
API reference read from the source); the other tests read the built files.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ckptlab

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_PAGES = sorted(p.relative_to(ROOT).with_suffix("") for p in (ROOT / "results").glob("[0-9][0-9]_*/default/*.ipynb"))


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(site.parent)})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def page_html(site: Path, src: str) -> str:
    path = Path(src).with_suffix("")
    path = path.parent if path.name == "index" else path
    return (site / path / "index.html").read_text()


def test_every_page_of_the_navigation_is_built(site):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = nav_pages(config["nav"]) + [f"{p}.ipynb" for p in NOTEBOOK_PAGES]
    assert len(pages) >= 20
    for src in pages:
        assert "<h1" in page_html(site, src), src
    home = page_html(site, "index.md")
    for page in NOTEBOOK_PAGES:  # the hook adds every executed notebook to the navigation
        assert f'href="{page.as_posix()}/"' in home, f"{page} is not in the navigation"


def test_every_notebook_page_shows_its_run_and_a_figure(site):
    assert len(NOTEBOOK_PAGES) >= 8
    for page in NOTEBOOK_PAGES:
        html = page_html(site, str(page))
        images = re.findall(r'<img [^>]*src="([^"]+)"', html)
        assert images, f"{page}: no figure"
        for src in images:
            if not src.startswith("data:"):
                assert (site / page / src).resolve().is_file(), f"{page}: figure {src} is not in the site"
        assert "jp-OutputArea" in html, f"{page}: no cell outputs"
    density = page_html(site, "results/02_density_sweep/default/02_density_sweep.ipynb")
    # its figure (embedded by the executed notebook, or the run folder's PNG) and its table
    assert re.search(r'<img [^>]*src="(data:image/png|[^"]*memory_time_vs_density\.png)', density) and "<table" in density


def test_api_reference_documents_every_public_name(site):
    html = page_html(site, "reference.md")
    ids = set(re.findall(r'id="(ckptlab\.[\w.]+)"', html))
    for name in ckptlab.__all__:
        if not name.startswith("__"):
            assert f"ckptlab.{name}" in ids, f"ckptlab.{name} is missing from the API reference"
    for module in ("report.analysis", "report.plots", "run.store"):
        assert any(i.startswith(f"ckptlab.{module}.") for i in ids), module


def test_the_site_reads_offline(site):
    """No page loads a script, a stylesheet or a font from the network (links to other sites are fine)."""
    for page in site.rglob("*.html"):
        html = page.read_text()
        assert not re.search(r'<script[^>]+src="https?:', html), page
        assert not re.search(r'<link[^>]+href="https?:[^"]*"[^>]*rel="stylesheet"|<link[^>]+rel="stylesheet"[^>]+href="https?:', html), page
        assert "fonts.googleapis" not in html and "unpkg.com" not in html, page
    for css in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(['\"]?https?:", css.read_text()), css


def test_strict_build_fails_on_a_broken_link_and_a_missing_page(tmp_path):
    """The site's own validation settings, on two pages with a broken link and a nav entry to nothing."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md) and [nowhere](no-such-page.md).\n")
    (docs / "guide.md").write_text("# Guide\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({
        "INHERIT": str(ROOT / "mkdocs.yml"), "docs_dir": str(docs), "hooks": [], "plugins": ["search"],
        "nav": ["index.md", "guide.md", "missing.md"]}))
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr and "missing.md" in done.stderr, done.stderr[-3000:]


def test_readme_links_point_to_files_in_the_repository():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(relative) >= 20
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
