"""The attention op and its compute paths: kernels and their dense twins, the entries an
attention call runs over, the streaming path, the Triton path (CUDA), half-precision
products, stochastic rounding.

The public names are importable from :mod:`rcdl`; docs/architecture.md draws the packages.
"""

# the compute paths other than the streaming one register themselves where they apply
from rcdl.ops import triton_attention as _triton_attention  # noqa: F401
