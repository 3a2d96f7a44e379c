"""Discovery: probes that each read one source of the host and return their part of the topology."""
