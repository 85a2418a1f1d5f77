"""The built-in tiny backbone and its pretraining; GGUF -> Hugging Face conversion."""
