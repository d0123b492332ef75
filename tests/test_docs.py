"""The README and docs/ hold what the code does: every code block runs here or is a shell example, every local
link resolves, every TrainConfig option is documented, and the error table holds every message the code raises."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import error_catalog
from jaxtune.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL = ("bash",)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_runs_or_is_a_shell_example(page):
    for lang, _ in _blocks(page):
        assert lang in ("python", *SHELL), f"{page.name}: a ```{lang} block is neither run nor a shell example"


DOC_PAGES_WITH_PYTHON = [p for p in PAGES if p.name != "README.md" and any(l == "python" for l, _ in _blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", DOC_PAGES_WITH_PYTHON, ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run(page, short_smollm2, tmp_path, monkeypatch):
    """Each page's Python blocks in order, in one namespace, from a scratch directory, `smollm2` cut to 2 layers
    (README's quickstart runs in test_readme_example.py)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, (lang, code) in enumerate(_blocks(page)):
        if lang == "python":
            exec(compile(code, f"{page.name} block {i}", "exec"), namespace)


def test_readme_runs_one_python_block_the_quickstart():
    assert [lang for lang, _ in _blocks(ROOT / "README.md")].count("python") == 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"\w+://", target):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120 and max(len(line) for line in lines if not line.startswith("|")) <= 120


def test_every_option_is_documented():
    text = (ROOT / "docs" / "training.md").read_text()
    for field in dataclasses.fields(TrainConfig):
        assert f"`{field.name}`" in text, f"TrainConfig.{field.name} is missing from docs/training.md"


def test_the_error_table_holds_every_message_the_code_raises():
    text = (ROOT / "docs" / "errors.md").read_text()
    table = text.split(error_catalog.BEGIN)[1].split(error_catalog.END)[0].strip()
    missing = [msg for _, msg, _ in error_catalog.messages() if error_catalog._cell(msg) not in table]
    assert not missing, f"docs/errors.md lacks {len(missing)} message(s), e.g. {missing[0]!r}: run python tests/error_catalog.py"
    assert table == error_catalog.table(), "docs/errors.md is out of date: run python tests/error_catalog.py"
