"""The commands: cli (zcvae train/pretrain/evaluate/...), aggregate, sweep, demo."""
