"""zcvae: a pretrained causal LM as a conditional VAE whose latent z captures the solution strategy."""

__version__ = "0.1.0"
