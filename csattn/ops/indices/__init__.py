"""Index lists (window, visible compressed range, concatenation) for sparse attention."""

from .naive import combine_indices, gather_rows_masked, range_indices, take_rows, window_indices

__all__ = ["combine_indices", "gather_rows_masked", "range_indices", "take_rows", "window_indices"]
