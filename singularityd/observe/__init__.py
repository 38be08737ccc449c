"""Observation of the daemon from outside: the change feed, Prometheus metrics, the spool directory."""
