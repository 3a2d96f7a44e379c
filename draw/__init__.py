"""Pictures of a MemoryTopology: pure functions of the message, no I/O."""
