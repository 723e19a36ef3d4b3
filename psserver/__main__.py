"""``python -m psserver``: the shard daemon."""

from psserver.main import main

raise SystemExit(main())
