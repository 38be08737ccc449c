"""Jobs' processes on the daemon's side: the runtime record, launch, watch, terminate, logs."""
