"""What a store remembers of its samples: provenance, attribution (and the readout cascade),
forgetting, budgets.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
