"""The CVAE around a Hugging Face causal LM: config, build (loading, LoRA, new rows), hf_compat (the only
module that touches transformers' or peft's internals), prefix (x-prefix sharing), branches, cvae (the
passes, one method each), decoding (the one greedy decoder)."""
