"""``python -m capture_arena.sglang install | uninstall | check`` (:mod:`capture_arena._install`)."""

from .._install import main

raise SystemExit(main())
