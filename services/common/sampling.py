"""Which sampling settings `generate` accepts (temperature, top-k, top-p), checked apart from the
sampler: this module imports no torch, so `meshtrain generate` refuses a bad value at once,
before the model, the checkpoint reader and torch load.

    check_sampling(temperature=0.8, top_k=50, top_p=0.95)
"""

from __future__ import annotations

from meshtrain.services.common.errors import ConfigError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raises ConfigError naming the first setting out of its range.

    Args:
        temperature: >= 0 (0 is greedy).
        top_k: None or >= 0 (0 keeps every token).
        top_p: None or in (0, 1].
    """
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
