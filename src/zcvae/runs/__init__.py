"""The run directory: file names, atomic writes, readers and its preparation for a run (rundir), what a run records
about itself (record), checkpoints, run names, the lock, the metric sinks. Imports nothing of zcvae above core/."""
