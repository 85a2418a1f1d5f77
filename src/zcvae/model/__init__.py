"""The CVAE around a Hugging Face causal LM: LoRA, z rows, forward paths, prefix cache, heads."""
