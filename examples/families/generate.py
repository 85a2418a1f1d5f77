"""Write the two user-data families of examples/families/ as JSONL, byte for byte the shipped files.

    python examples/families/generate.py                      # rewrite the shipped files here
    python examples/families/generate.py --output-dir DIR     # or somewhere else

Both families are data a user would bring: pairs (x, y) with a gold `strategy` label, not built-in
tasks (no parser, no vocabulary of their own in zcvae). x is 3-5 single digits; each strategy maps x
to y deterministically; the strategy is drawn uniformly per train line. README.md here describes them.

- `late` (K = 3): `reverse` names itself at y's first word; `repeat` and `rotate` both start by
  restating x ("say d1 .. dn") and part only at the word after it (y position len(x) + 1 = 4-6).
  Every y names its strategy, so the reachable NMI is 1.
- `ambiguous` (K = 3): y is the output alone, with no marker word. `copy` and `reverse` give the
  same y exactly when x is a palindrome (a quarter of the inputs are drawn as palindromes); `double`
  never coincides with either. For those rows the posterior cannot beat 1/2, so the reachable NMI is
  below 1.

Splits: every x belongs to one split by a SHA-256 hash of the family name and x (1 in 10 to val), so
val measures unseen inputs. Train holds NUM_TRAIN lines, x drawn with repeats, strategy uniform. Val
holds NUM_VAL_INPUTS distinct x, each once under every strategy (in `STRATEGIES` order): zcvae can see
that two strategies share a y of user data only when the same (x, y) occurs with both labels, so
listing every strategy makes the `nmi_reachable` that evaluation reports equal the exact value below.

Reachable NMI (`family_stats`): the Bayes-optimal posterior over strategies of a val row is uniform
over the strategies whose y for x is the row's y (uniform prior, deterministic maps); its argmax
(ties to the smallest name, as `zcvae.eval.metrics.reachable_nmi` breaks them) against the gold
strategy, scored by scikit-learn's NMI (arithmetic normalisation, as zcvae's `nmi`).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

from zcvae.data import Example, write_jsonl
from zcvae.eval.metrics import reachable_nmi

HERE = Path(__file__).resolve().parent
FAMILIES = ("late", "ambiguous")
STRATEGIES = {"late": ("reverse", "repeat", "rotate"), "ambiguous": ("copy", "reverse", "double")}
NUM_TRAIN = 4000
NUM_VAL_INPUTS = 100  # x; val holds one line per (x, strategy)
PALINDROME_SHARE = 0.25  # of the `ambiguous` family's inputs
SEED = 0
END = "."


def _stable_seed(*parts: object) -> int:
    """64 bits of SHA-256 of the parts: the same on every machine and Python (unlike `hash()`)."""
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def split_of(family: str, x: str) -> str:
    return "val" if _stable_seed(family, x) % 10 == 0 else "train"


def _is_palindrome(digits: list[str]) -> bool:
    return digits == digits[::-1]


def sample_x(family: str, rng: random.Random) -> str:
    n = rng.randint(3, 5)
    if family == "ambiguous":
        if rng.random() < PALINDROME_SHARE:
            half = [str(rng.randrange(10)) for _ in range((n + 1) // 2)]
            return " ".join(half + half[: n // 2][::-1])
        while True:  # the other inputs are never palindromes, so the share is exactly the draw's
            digits = [str(rng.randrange(10)) for _ in range(n)]
            if not _is_palindrome(digits):
                return " ".join(digits)
    return " ".join(str(rng.randrange(10)) for _ in range(n))


def render(family: str, x: str, strategy: str) -> str:
    """The y of `strategy` for x: a deterministic map per strategy."""
    d = x.split()
    if family == "late":
        body = {
            "reverse": ["rev", *d[::-1]],
            "repeat": ["say", *d, "again", *d],
            "rotate": ["say", *d, "shift", *d[1:], d[0]],
        }[strategy]
    else:
        body = {"copy": d, "reverse": d[::-1], "double": [w for digit in d for w in (digit, digit)]}[strategy]
    return " ".join([*body, END])


def make_split(family: str, split: str) -> list[Example]:
    rng = random.Random(_stable_seed(family, SEED, split))
    strategies = STRATEGIES[family]

    def draw() -> str:
        while True:
            x = sample_x(family, rng)
            if split_of(family, x) == split:
                return x

    if split == "train":
        out = []
        for i in range(NUM_TRAIN):
            x = draw()
            strategy = strategies[rng.randrange(len(strategies))]
            out.append(Example(id=f"{family}-train-{i}", x=x, y=render(family, x, strategy), strategy=strategy))
        return out
    inputs: list[str] = []
    while len(inputs) < NUM_VAL_INPUTS:
        x = draw()
        if x not in inputs:
            inputs.append(x)
    return [Example(id=f"{family}-val-{i}-{s}", x=x, y=render(family, x, s), strategy=s)
            for i, x in enumerate(inputs) for s in strategies]


def candidates(family: str, example: Example) -> tuple[str, ...]:
    """The strategies that map example.x to example.y: the support of the Bayes posterior."""
    return tuple(s for s in STRATEGIES[family] if render(family, example.x, s) == example.y)


def family_stats(family: str, examples: list[Example]) -> dict[str, float]:
    """The share of rows whose y more than one strategy gives, and the reachable NMI (module docstring)."""
    support = [candidates(family, e) for e in examples]
    assert all(e.strategy in c for e, c in zip(examples, support)), "a row's own strategy must produce its y"
    nmi, _ = reachable_nmi([(e.x, e.y) for e in examples], [e.strategy for e in examples], support)
    return {"ambiguous_fraction": sum(len(c) > 1 for c in support) / len(examples), "nmi_reachable": nmi}


def file_name(family: str, split: str) -> str:
    return f"{family}-{split}.jsonl"  # distinct stems: a sweep names its entangled stage after the stem


def write(output_dir: Path) -> None:
    for family in FAMILIES:
        for split in ("train", "val"):
            examples = make_split(family, split)
            write_jsonl(output_dir / file_name(family, split), examples)
            stats = family_stats(family, examples)
            print(f"{family} {split}: {len(examples)} lines, ambiguous {stats['ambiguous_fraction']:.4f}, "
                  f"reachable NMI {stats['nmi_reachable']:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=HERE, help="where to write the JSONL files (default: here)")
    args = parser.parse_args(argv)
    write(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
