"""Rotations into and out of the cache's basis; references: naive.rotate_queries_reference and
naive.merge_and_unrotate_reference."""

from .rotation import RotatedQuery, merge_and_unrotate, rotate_queries

__all__ = ["RotatedQuery", "merge_and_unrotate", "rotate_queries"]
