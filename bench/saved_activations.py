"""What autograd saves for the backward in a real `zcvae train` step: the distinct storages packed while the CVAE
objective computes each micro-batch loss, in MiB, total and by (last dimension, dtype) (BENCHMARKS.md, "Host memory").

    python bench/saved_activations.py train --backbone /tmp/shapes/SmolLM2-360M-bfloat16 --base-dtype bfloat16 \\
        --allow-fresh-markers --task copy --max-steps 1 --micro-batch-size 1 --num-train-examples 8 --num-val-examples 4 \\
        --num-eval-decode-examples 0 --reference-policy online --no-progress-bar --output-dir /tmp/sa

Parameters (leaves) are left out. What a checkpointed region saves only in its recompute is not counted: the
non-reentrant checkpoint packs with hooks of its own.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main(argv: list[str]) -> int:
    import torch

    import zcvae.train.trainer as trainer
    from zcvae.commands.cli import main as cli_main

    micro_loss = trainer.CVAEObjective.micro_loss

    def counted(self, *args, **kwargs):
        sizes: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not t.is_leaf:
                sizes[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = (tuple(t.shape), t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = micro_loss(self, *args, **kwargs)
        by = collections.Counter()
        for (_, nbytes), (shape, dtype) in sizes.items():
            by[(shape[-1] if shape else 0, str(dtype).removeprefix("torch."))] += nbytes
        print(f"SAVED {sum(by.values()) / 2**20:.1f} MiB", flush=True)
        for (last, dtype), nbytes in by.most_common(8):
            print(f"  last dim {last:>6} {dtype:<9} {nbytes / 2**20:7.1f} MiB", flush=True)
        return out

    trainer.CVAEObjective.micro_loss = counted
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
