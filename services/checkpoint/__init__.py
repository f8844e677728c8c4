"""Checkpoint: layout-independent zarr v3 checkpoints with a manifest written last as the commit."""
