"""Scheduling: the pure policy and the round that applies it to a view of the cluster."""
