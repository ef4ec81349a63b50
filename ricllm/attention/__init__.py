"""Attention over the paged KV cache: one metadata object per step, backends behind one interface."""

from ricllm.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
