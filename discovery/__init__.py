"""Discovery: probes that each read one source of the host (through a root) and return their part of
the topology (``probes.py`` declares them, ``discover.py`` schedules them, ``assemble.py`` builds the
MemoryTopology); ``helper.py``/``isolated.py`` run them in a child so a crash costs only its sources."""
