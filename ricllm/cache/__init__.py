"""The fixed-budget paged KV cache: the preallocated tensors and the blocks that index them."""
