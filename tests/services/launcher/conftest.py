"""Launcher tests train small real models: the trainer tests' corpus fixture."""

from tests.services.trainer.conftest import corpus_cache  # noqa: F401  (a fixture, found by name)
