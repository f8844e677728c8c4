"""Hugging Face checkpoints: export to and import from `transformers` model folders
(`convert.py`), with the Llama and mixture-of-experts families' configs and mappings
(`llama.py`, `moe.py`), reading a model folder (`files.py`), writing safetensors (`write.py`)
and the run's tokenizer (`tokenizer.py`)."""
