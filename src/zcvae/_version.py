"""The package version (a leaf module, so code inside zcvae need not import the public-API facade)."""

__version__ = "0.1.0"
