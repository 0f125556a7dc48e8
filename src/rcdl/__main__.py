"""``python -m rcdl`` runs the command-line interface."""

from rcdl.cli import main

raise SystemExit(main())
