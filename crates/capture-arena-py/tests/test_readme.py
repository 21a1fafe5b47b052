"""The Python guide's examples (docs/python.md, linked from README) run as written."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "python.md"


def test_python_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) == 2, "the sink example and the trainer example"
    ns: dict = {}
    for code in blocks:
        exec(compile(code, str(GUIDE), "exec"), ns)
    ns["sink"].close()
