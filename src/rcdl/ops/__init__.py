"""The attention op and its compute paths: kernels and their dense twins, the entries an
attention call runs over, the streaming path, half-precision products, stochastic rounding.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
