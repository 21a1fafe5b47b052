# coding=utf-8
"""Inference / rollout plane: rollout worker, capture config, adapters, target engines.

Submodules import the SpecForge model / SGLang code, so they are imported
explicitly by callers rather than at package load.
"""
