"""Observation of the daemon from outside: the change feed (metrics and a spool directory later)."""
