"""Trainer: config, single-device GPT model, optimizer, schedule and the training loop."""
