"""The top floor: every command's argument parsing and output. Nothing below imports it.

Each command module builds its parser from the standard library alone and imports what its handler
needs inside the handler, so ``memtopo --help`` loads no grpc, protobuf, discovery or planner.
"""
