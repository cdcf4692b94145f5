"""Fused ops for the sliding engine and for plain HF models.

Each op dispatches to its Triton kernel on CUDA when Triton is available, and to the pure-torch
reference otherwise.
"""
from .reference import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
