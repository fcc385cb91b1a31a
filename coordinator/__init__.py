"""Cluster-wide atomic recipe switch: coordinator, per-rank participant, transports."""
