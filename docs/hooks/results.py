"""mkdocs hook: the executed notebooks under results/ and their figures become pages of the site.

They are added at their repository paths (results/<notebook>/default/...), so a page links to a
notebook or a figure the way the README does. Only the `default` parameter set is published (the
committed `make run`); its notebooks fill the "Notebooks" section of the navigation, in order, so
a notebook added to `make run` gets its page without editing mkdocs.yml. Two things make the pages read well offline:

- progress-bar widgets are dropped from the rendered copy (their state says nothing about the
  results, and rendering it would load the widget manager from a CDN);
- `make run` writes figures as PNG files beside each executed notebook: a notebook page whose
  cells show no image gets its run folder's figures appended, so every page shows what its run drew.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
NOTEBOOKS = "[0-9][0-9]_*/default/*.ipynb"
FIGURES = ("[0-9][0-9]_*/default/*.png", "browser-check/*.png", "published/*.png")  # published.md shows the last
RENDERED = ROOT / ".cache" / "docs-notebooks"  # the copies mkdocs-jupyter renders (git-ignored)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def rendered_copy(notebook: Path) -> Path:
    """`notebook` without widget outputs and widget state, under RENDERED at the same relative path."""
    nb = json.loads(notebook.read_text())
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = [o for o in cell["outputs"] if WIDGET_VIEW not in o.get("data", {})]
    copy = RENDERED / notebook.relative_to(ROOT)
    copy.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if not copy.exists() or copy.read_text() != text:  # unchanged copies keep mkdocs-jupyter's cache
        copy.write_text(text)
    return copy


def notebook_title(notebook: Path) -> str:
    """"02 Density sweep" for results/02_density_sweep/default/02_density_sweep.ipynb."""
    number, _, name = notebook.stem.partition("_")
    return f"{number} {name.replace('_', ' ').capitalize()}"


def on_config(config):
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Notebooks" in entry:
            pages = [p for p in entry["Notebooks"] if not str(p).startswith("results/")]
            entry["Notebooks"] = pages + [{notebook_title(nb): nb.relative_to(ROOT).as_posix()}
                                          for nb in sorted(RESULTS.glob(NOTEBOOKS))]
    return config


def _add(files, src_dir: Path, src_uri: str, config) -> None:
    files.append(File(src_uri, str(src_dir), config["site_dir"], config["use_directory_urls"]))


@event_priority(100)  # before mkdocs-jupyter, which turns the .ipynb files it is given into pages
def on_files(files, config):
    for notebook in sorted(RESULTS.glob(NOTEBOOKS)):
        rendered_copy(notebook)
        _add(files, RENDERED, notebook.relative_to(ROOT).as_posix(), config)
    for pattern in FIGURES:
        for figure in sorted(RESULTS.glob(pattern)):
            _add(files, ROOT, figure.relative_to(ROOT).as_posix(), config)
    return files


def on_page_content(content, page, config, files):
    if not page.file.src_uri.endswith(".ipynb") or "<img" in content:
        return content
    figures = []
    for png in sorted((ROOT / page.file.src_uri).parent.glob("*.png")):
        target = files.get_file_from_path(png.relative_to(ROOT).as_posix())
        if target is not None:
            figures.append(f'<figure><img src="{html.escape(target.url_relative_to(page.file))}" '
                           f'alt="{html.escape(png.stem)}"><figcaption>{html.escape(png.name)}</figcaption></figure>')
    if not figures:
        return content
    return content + '<h2 id="figures-of-this-run">Figures of this run</h2>\n' + "\n".join(figures)
