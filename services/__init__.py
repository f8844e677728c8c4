"""meshtrain services: dataloader, checkpoint and trainer, each also a plain Python library."""
