"""Synthetic tasks that train on CPU in minutes."""

from async_april.tasks.reverse import make_reverse_rows

__all__ = ["make_reverse_rows"]
