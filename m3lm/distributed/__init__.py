"""Tensor and expert parallelism on torch.distributed: process group, shard plan, step messages, launch."""
