"""muon_dist: an FSDP2/DTensor-native distributed Muon optimizer."""

from muon_dist import kernels
from muon_dist.optimizer import Muon
from muon_dist.qk_clip import MaxLogitTracker, QKClip
from muon_dist.routing.names import normalize_fqn
from muon_dist.routing.param_groups import param_groups

__all__ = ["MaxLogitTracker", "Muon", "QKClip", "kernels", "normalize_fqn", "param_groups"]
__version__ = "0.1.0"
