"""singularityd: a preemptive, elastic scheduler for AI workloads on the accelerators of a lab."""

__version__ = "0.1.0"
