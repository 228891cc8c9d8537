"""What the ranks agree on, on the device: gradients and results, the host's report of the
outcome, and where a rank's own failures are flagged."""
