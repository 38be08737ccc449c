"""The accelerators the daemon owns: the inventory (NVML or virtual) and the device proxies."""
