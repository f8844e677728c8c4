"""Tokenizers and their spec strings: `base.py` holds the common surface and the byte, Hugging
Face, tiktoken and SentencePiece tokenizers (and `build_tokenizer`, spec to tokenizer),
`megatron.py` the tokenizers named the way Megatron-LM names them, and `files.py` the files
behind a spec, which checkpoints carry."""
