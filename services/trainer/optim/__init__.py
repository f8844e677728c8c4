"""AdamW with decoupled weight decay and the learning-rate schedule."""
