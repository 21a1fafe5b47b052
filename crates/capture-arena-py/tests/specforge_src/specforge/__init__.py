"""SpecForge package.

Training is configured through :mod:`specforge.cli`; implementation types live
in their owning subpackages and are not re-exported through a compatibility API.
"""
