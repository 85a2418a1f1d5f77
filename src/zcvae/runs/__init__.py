"""The run directory: file names, atomic writes, readers (rundir), checkpoints, run names. Imports nothing of zcvae."""
