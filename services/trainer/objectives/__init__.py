"""Training objectives: what language modeling, preference tuning (DPO) and GRPO each supply
the training loop (`base.Objective`)."""
