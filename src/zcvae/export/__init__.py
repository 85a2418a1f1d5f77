"""Export of a trained run, loading it back, the model card, generate/encode."""
