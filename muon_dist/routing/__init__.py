"""A model's parameters as Muon and AdamW param groups, by evidence of structure."""
