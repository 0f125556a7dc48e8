"""Top-k retrieval: indices over a store's keys and the attention over each query's top-k rows.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
