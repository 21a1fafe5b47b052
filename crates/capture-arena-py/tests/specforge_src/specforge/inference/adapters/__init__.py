# coding=utf-8
"""Feature-source adapters for external server transport."""
