"""Exports of a trained run: format (the directory's file names), export (writing one), load (an
export or a run back as a model, decode/encode), card (the model card), cli (export/generate/encode)."""
