"""Megatron Core checkpoints: import and export of `torch_dist` folders (`torch_dist.py`) and
the model architecture read from Megatron-LM's saved args and flags (`args.py`)."""
