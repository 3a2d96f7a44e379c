"""``python -m memtopo.cli`` = ``memtopo``."""

from memtopo.cli.main import run

run()
