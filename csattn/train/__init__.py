"""Training: a document packer over a token stream, the DP x CP training loop, checkpoints, ``csattn train``."""
