"""Generated wire types of memtopo (``memtopo.v1``); the sources are in ``proto/``."""
