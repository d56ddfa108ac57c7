"""Parallel engines: what each rank holds under DDP, FSDP2, DeepSpeed ZeRO, Megatron, and pipeline stages."""
