"""A wing per update rule: what a rule adds to the step, in one module named for it."""
