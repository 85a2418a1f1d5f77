"""z-free reference statistics: the store (format, fingerprint), c_base per mode, the provider, the health check."""
