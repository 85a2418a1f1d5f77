#!/usr/bin/env python3
"""Render one SLURM script per run of a family, as `zcvae sweep FAMILY.yaml --out DIR` does (the logic lives
in zcvae.sweep, under test; the template ships in the package: src/zcvae/sweep/slurm.sbatch).

    python launch/sweep.py FAMILY.yaml --out DIR [--dry-run] [--defaults {auto,config,base}] [--force]
    bash DIR/submit.sh      # each entangled stage first, every run after its stage
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
