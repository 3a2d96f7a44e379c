"""The agent: CLI, daemon, gRPC services, controller link, health and metrics."""
