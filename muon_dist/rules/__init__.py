"""The update rules: what a step computes, written once."""
