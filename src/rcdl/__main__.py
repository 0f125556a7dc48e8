"""``python -m rcdl`` runs the command-line interface."""

from rcdl.app.cli import entry

raise SystemExit(entry())
