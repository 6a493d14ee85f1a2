"""`verispec bench`: workloads, modes, runner and report."""
