"""``python -m memtopo.cli`` = ``memtopo``."""

from memtopo.cli.main import main

raise SystemExit(main())
