"""Tensor parallelism over torch.distributed: T ranks split each layer's heads and MLP channels
(docs/tensor-parallel.md). Rank 0 is the engine's process; the others are local worker processes."""
