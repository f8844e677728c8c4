"""Dataloader: Megatron-compatible indexed datasets, tokenizers, GPT sample windows, batches."""
