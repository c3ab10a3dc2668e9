"""Ops: each folder holds a plain-PyTorch reference (``naive.py``) and, where speed matters, a Triton path."""
