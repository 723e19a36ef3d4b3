"""``python -m psctl``: the operator's tool."""

from psctl.main import main

raise SystemExit(main())
