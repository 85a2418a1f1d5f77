"""zcvae: a pretrained causal LM as a conditional VAE whose latent z captures the solution strategy."""

from zcvae._version import __version__
