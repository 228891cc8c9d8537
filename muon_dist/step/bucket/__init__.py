"""One bucket as a generator task: the skeleton every bucket runs, its reads and writes, and
the owner's Newton–Schulz."""
