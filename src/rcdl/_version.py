"""The package version (single source; read by pyproject.toml and re-exported by rcdl)."""

__version__ = "0.1.0"
