"""Training objectives besides the language-model loss (preference tuning)."""
