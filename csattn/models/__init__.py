"""Whole models built around :class:`csattn.HybridAttention`."""
