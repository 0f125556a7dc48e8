"""What writes and moves entries: the learning rules and their age coefficients, the growth
triggers, the Grower, Adam on the entries, and the dual-form optimizers FOOF and DeltaNet.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""
