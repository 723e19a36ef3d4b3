"""``python -m psworker``: the worker command."""

from psworker.main import main

raise SystemExit(main())
