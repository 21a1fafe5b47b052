"""The README's "From Python" examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_python_examples_run():
    text = README.read_text()
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the sink example and the trainer example"
    ns: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)
    ns["sink"].close()
