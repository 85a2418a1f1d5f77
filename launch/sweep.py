#!/usr/bin/env python3
"""Render one SLURM script per run of a family: see zcvae.commands.sweep (the logic lives there, under test).

    python launch/sweep.py FAMILY.yaml --out DIR [--dry-run] [--defaults {auto,config,base}] [--force]
"""

import sys
from pathlib import Path

try:
    from zcvae.commands.sweep import main
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from zcvae.commands.sweep import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
