"""``python -m rcdl`` runs the command-line interface."""

from rcdl.cli import entry

raise SystemExit(entry())
