"""Turns the single-device model into a sharded / memory-planned one. Today: recompute."""
