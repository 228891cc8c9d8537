"""How a step is launched: from gradient hooks during backward, in the mode the overlap
choice picks, or replayed from a CUDA graph."""
