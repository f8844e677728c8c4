"""meshtrain: Megatron-style training of GPT-family language models."""
