"""The abuse corpus runs under pytest: `.venv/bin/python -m pytest attacks` (scripts/test.sh does)."""

from _common import sink  # noqa: F401  (the fixture every attack uses)
