"""This rank's local shards: where each view's reads and writes happen, the device scalars
they use, and the writes a transactional step holds."""
