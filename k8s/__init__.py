"""Kubernetes: the NodeResourceTopology object memtopo publishes, the kubelet facts it reads, the publisher."""
