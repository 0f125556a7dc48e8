"""The training loop, evaluation and checkpoints.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
