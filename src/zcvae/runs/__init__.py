"""The run directory: file names, atomic writes, readers (rundir), checkpoints, run names, the lock, the metric sinks. Imports nothing of zcvae."""
