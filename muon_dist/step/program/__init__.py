"""The Muon phase as one program per step mode, decided when the step is bound to its plan."""
