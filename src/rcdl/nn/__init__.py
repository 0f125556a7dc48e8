"""The growing layers and what they are made of: the entry store, the records of training
calls, the backends, the divergence guard, the layers, the hybrid layer, the networks.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
