"""Attention kernels behind one packed-varlen signature."""

from embedpipe.kernels.attention import BACKENDS, attention, available_backends, plan_attention, select_backend

__all__ = ["BACKENDS", "attention", "available_backends", "plan_attention", "select_backend"]
