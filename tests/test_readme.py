"""Every ```python block in README.md and docs/**/*.md runs as written, and printed output shown
under a block has the shape of what the block prints when run.

Conventions (also in docs/development.md):
- each ```python block runs on its own, in a fresh module namespace, in a temporary working
  directory (files a block writes, such as results/my-sweep, land there);
- a ```text block directly after a ```python block is its printed output: the lines must match one
  for one, with the same words in the same order and the same sizes (77.8 MiB), other numbers
  aside (timings differ between runs);
- `<!-- not-run: REASON -->` on the line just before a block's fence keeps it out of the run (a
  GPU, a cluster, minutes of work); the reason must be given, and the block must still compile.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)[^`]*$")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
SIZE = re.compile(r" ?(?:[KMGT]iB|B)\b")   # after a number: a size in bytes


@dataclass
class Block:
    path: Path
    line: int              # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None    # the reason given in a not-run comment
    output: str | None = None  # the ```text block right after it

    @property
    def name(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{path}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown file, nested fences (```` around ```) respected."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    previous_end = -2  # index of the closing fence of the last block
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(before)
        block = Block(path, i + 1, language, "\n".join(lines[i + 1:j]) + "\n", marker.group(1) if marker else None)
        follows = blocks and previous_end >= 0 and all(not l.strip() for l in lines[previous_end + 1:i])
        if language == "text" and follows and blocks[-1].language == "python" and blocks[-1].output is None:
            blocks[-1].output = block.code
        blocks.append(block)
        previous_end, i = j, j + 1
    return blocks


PYTHON_BLOCKS = [b for path in DOCUMENTS for b in code_blocks(path) if b.language == "python"]


def shape(text: str) -> list[str]:
    """Lines with runs of whitespace collapsed and every number replaced by N but sizes (77.8 MiB,
    512 B): bytes measured on a CPU and predicted are the same on every run, timings are not."""
    return [NUMBER.sub(lambda m: m.group() if SIZE.match(m.string, m.end()) else "N", " ".join(line.split()))
            for line in text.strip("\n").splitlines()]


def run_block(block: Block) -> str:
    module = types.ModuleType(f"docs_block_{block.line}")
    module.__file__ = str(block.path)
    sys.modules[module.__name__] = module
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, block.name, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return printed.getvalue()


def test_the_documents_have_python_blocks():
    names = {b.path.name for b in PYTHON_BLOCKS}
    assert "README.md" in names and len(PYTHON_BLOCKS) >= 10
    assert any(b.output for b in PYTHON_BLOCKS if b.path.name == "README.md"), "the README shows real output"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_runs(block: Block, tmp_path, monkeypatch):
    if block.not_run:
        compile(block.code, block.name, "exec")  # still valid Python
        pytest.skip(f"not-run: {block.not_run}")
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    printed = run_block(block)
    if block.output is not None:
        assert shape(printed) == shape(block.output), (
            f"{block.name} printed\n{printed}\nbut the document shows\n{block.output}")


def test_block_parser_finds_output_nested_fences_and_not_run_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("````markdown\n```python\nraise SystemExit\n```\n````\n\n"
                   "<!-- not-run: needs a CUDA device -->\n```python\nimport cuda_only\n```\n\n"
                   "```python\nprint('peak', 3.0, 'MiB')\n```\n\n```text\npeak 3.0 MiB\n```\n")
    blocks = [b for b in code_blocks(doc) if b.language == "python"]
    assert [(b.line, b.not_run, b.output) for b in blocks] == [
        (8, "needs a CUDA device", None), (12, None, "peak 3.0 MiB\n")]
    assert shape(run_block(blocks[1])) == shape(blocks[1].output)
    assert shape("peak 3.0 GiB") != shape("peak 3.0 MiB") and shape("a  1\n") != shape("a 1\nb 2")
    assert shape("peak 3.0 MiB in 12 ms") == shape("peak 3.0 MiB in 15 ms") != shape("peak 3.1 MiB in 12 ms")
