"""Pure decisions, no I/O: job states and transitions, and the job state machine."""
