"""Generated from proto/memtopo/v1 by tools/gen_proto.sh; do not edit."""
