"""The W4A4 GEMM emulated exactly (the `emulate` path, any GPU); reference: naive.w4a4_reference."""

from .emulate import emulated_linear

__all__ = ["emulated_linear"]
