"""The optimizer's state: created per group, saved, loaded, rebound to new storage."""
