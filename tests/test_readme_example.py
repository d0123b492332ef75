"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_python_example_runs(short_smollm2, tmp_path, monkeypatch, capsys):
    """On SmolLM2 cut to 2 layers (`short_smollm2`): the code runs as written; `make demo` shows what it learns."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(README.parent)
    code = code.replace('out_dir="runs/readme"', f'out_dir="{tmp_path / "run"}"')
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["result"].steps == 2 and (tmp_path / "run" / "metrics.jsonl").exists()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("remat auto: selective (")  # train() says which remat policy it picked and why
    assert printed[-1].startswith("['") and len(printed[-1]) > 10
