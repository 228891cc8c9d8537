"""Adapters that plug :class:`muon_dist.Muon` into training frameworks (optional imports)."""
