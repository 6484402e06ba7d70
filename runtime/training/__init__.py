"""Training across processes: the torchrun contract, the rank-0 hand-out of groups, and the training backends."""
