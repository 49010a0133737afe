"""``python -m undercurrent``: the same as the ``undercurrent`` command."""

from undercurrent.cli import main

raise SystemExit(main())
