"""Vision-language data: image-text records from WebDataset shards (Energon-prepared or plain) or
a folder with a JSONL, decoded and tokenized into micro-batches by the data worker."""
