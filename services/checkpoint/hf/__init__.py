"""Hugging Face checkpoints: export to and import from `transformers` model folders
(`convert.py`) through the mapping of configs and tensors (`mapping.py`, with GPT-2's tables;
the Llama and mixture-of-experts families' are `llama.py` and `moe.py`), reading a model folder
(`files.py`), writing safetensors (`write.py`) and the run's tokenizer (`tokenizer.py`)."""
