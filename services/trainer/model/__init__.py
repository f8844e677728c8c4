"""Single-device GPT-family model; `parallel/` turns it into a sharded one."""

from meshtrain.services.trainer.model.gpt import GPT

__all__ = ["GPT"]
