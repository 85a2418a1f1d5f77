"""The task-family protocol: an example, a parsed y, and the base class every family implements.

What a family must provide and the layout every built-in family follows (marker or restated x first,
a deterministic trace, "." last) are described in ``zcvae.data.tasks``, which also holds the registry.
This module owns what all families share: deterministic example generation from (task name, seed,
split, index), the hash split of inputs, parsing's outer frame, and the word helpers the families'
parsers use.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DIGITS",
    "END",
    "FAILED",
    "LETTERS",
    "SPLITS",
    "Example",
    "ParsedY",
    "TaskFamily",
    "is_digits",
    "is_letters",
    "read_digits",
    "split_once",
]

SPLITS = ("train", "val", "test")
# x -> split by hash bucket (of 10): train 80%, val 10%, test 10%.
_SPLIT_BUCKETS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
# Redraws of x until it falls in the requested split; val/test accept 1 draw in 10, so 1,000 draws
# fail with probability 0.9**1000 ~ 1e-46.
_MAX_DRAWS = 1000

END = "."
DIGITS = tuple("0123456789")
LETTERS = tuple("abcdefgh")


@dataclass(frozen=True)
class Example:
    """One example: input x, output y (whitespace-separated words) and, when known, its gold strategy."""

    id: str
    x: str
    y: str
    strategy: str | None = None


@dataclass(frozen=True)
class ParsedY:
    """What `TaskFamily.parse` reads back from a y.

    strategy: the strategy named by y's first word, or None when that word is no known marker.
    answer: the answer y arrives at (same format as `TaskFamily.answer`), or None unless parse_ok.
    parse_ok: whether y is a complete, well-formed, internally consistent trace of `strategy`.
    """

    strategy: str | None
    answer: str | None
    parse_ok: bool


FAILED = ParsedY(strategy=None, answer=None, parse_ok=False)


def _stable_seed(*parts: object) -> int:
    """A 64-bit integer from SHA-256 of the parts: identical across processes and Python versions."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def is_digits(words: Sequence[str]) -> bool:
    return len(words) > 0 and all(w in DIGITS for w in words)


def is_letters(words: Sequence[str]) -> bool:
    return len(words) > 0 and all(w in LETTERS for w in words)


def split_once(words: Sequence[str], sep: str) -> tuple[list[str], list[str]] | None:
    """(left, right) around the only occurrence of sep, or None if sep occurs zero or several times."""
    if list(words).count(sep) != 1:
        return None
    cut = list(words).index(sep)
    return list(words[:cut]), list(words[cut + 1 :])


def read_digits(task: "TaskFamily", x: str, *, max_len: int) -> list[str]:
    """x as a list of 1..max_len single digits (sort and sort3 read the same x); ValueError otherwise."""
    digits = x.split()
    if not is_digits(digits) or len(digits) > max_len:
        raise task._bad_x(x, f"expected 1-{max_len} single digits separated by spaces")
    return digits


class TaskFamily:
    """A family of synthetic tasks whose inputs admit several strategies.

    Subclasses set `name`, `strategies`, `description`, `markers` (strategy -> first y word) and
    implement `_sample_x`, `_read_x`, `_render_body`, `_parse_body`, `_answer` and `_words`.
    """

    name: str
    strategies: tuple[str, ...]
    description: str
    markers: Mapping[str, str]
    # True for families whose y restates x first, so that the strategies part only after a shared
    # prefix (see zcvae.data.tasks); False for the marker-first families (decision at 0).
    late_decision: bool = False
    # How often two strategies give the same y, in words (the number is tested).
    ambiguity: str = "none: every strategy gives a different y for every x"

    # ---- public API -------------------------------------------------------------------------------

    def example(self, *, seed: int, split: str, index: int, strategy: str | None = None) -> Example:
        """The example number `index` of `split` under `seed`; `strategy` forces the strategy.

        x does not depend on `strategy`, so forcing each strategy in turn gives the same x.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if split not in _SPLIT_BUCKETS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be an int >= 0, got {index!r}")
        if strategy is not None:
            self._check_strategy(strategy)
        rng = random.Random(_stable_seed(self.name, seed, split, index))
        for _ in range(_MAX_DRAWS):
            x = self._sample_x(rng)
            if self.split_of(x) == split:
                break
        else:  # pragma: no cover - probability ~1e-46
            raise RuntimeError(f"{self.name}: no x for split {split!r} after {_MAX_DRAWS} draws")
        # Draw the strategy even when it is forced, so the rng stream (and any later use) is the same.
        drawn = self.strategies[rng.randrange(len(self.strategies))]
        chosen = drawn if strategy is None else strategy
        return Example(
            id=f"{self.name}-{split}-{seed}-{index}", x=x, y=self.render(x, chosen), strategy=chosen
        )

    def split_of(self, x: str) -> str:
        """The split that owns input x (splits hold disjoint inputs)."""
        bucket = _stable_seed(self.name, " ".join(x.split())) % 10
        return next(split for split, buckets in _SPLIT_BUCKETS.items() if bucket in buckets)

    def render(self, x: str, strategy: str) -> str:
        """The gold y for x under `strategy`. ValueError if x is malformed or strategy unknown."""
        self._check_strategy(strategy)
        parsed_x = self._read_x(x)
        return " ".join([self.markers[strategy], *self._render_body(parsed_x, strategy), END])

    def parse(self, y: str) -> ParsedY:
        """Read a (possibly generated, possibly garbage) y back. Never raises."""
        if not isinstance(y, str):
            return FAILED
        words = y.split()
        if not words:
            return FAILED
        strategy = self._strategy_of_marker().get(words[0])
        if strategy is None:
            return FAILED
        if len(words) < 2 or words[-1] != END or END in words[1:-1]:
            return ParsedY(strategy=strategy, answer=None, parse_ok=False)
        answer = self._parse_body(words[1:-1], strategy)
        return ParsedY(strategy=strategy, answer=answer, parse_ok=answer is not None)

    def answer(self, x: str) -> str:
        """The strategy-independent correct answer for x. ValueError if x is malformed."""
        return self._answer(self._read_x(x))

    def decision_positions(self, x: str) -> tuple[int, ...]:
        """The y word positions (0-based) where the gold ys of two strategies first differ, sorted.

        One entry per distinct position over all pairs of strategies whose ys differ (a y that is a
        prefix of another differs at its length). With the built-in word-level tokenizer a word
        position is also the y token position. ValueError if x is malformed.
        """
        ys = [self.render(x, s).split() for s in self.strategies]
        positions = set()
        for i in range(len(ys)):
            for j in range(i + 1, len(ys)):
                a, b = ys[i], ys[j]
                if a == b:
                    continue
                positions.add(next((t for t, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b))))
        return tuple(sorted(positions))

    def equivalent_strategies(self, x: str) -> list[tuple[str, ...]]:
        """Groups (in `strategies` order) of two or more strategies that give the same y for x."""
        groups: dict[str, list[str]] = {}
        for strategy in self.strategies:
            groups.setdefault(self.render(x, strategy), []).append(strategy)
        return [tuple(group) for group in groups.values() if len(group) > 1]

    def y_entropy(self, x: str) -> float:
        """H(y | x) in nats with the strategy drawn uniformly: strategies that render one y count as one.

        The best z-free y-sequence NLL of x (a backbone's floor): log S when every strategy gives its
        own y, less when some coincide (`mul` with b = 1). ValueError if x is malformed.
        """
        counts = Counter(self.render(x, strategy) for strategy in self.strategies)
        total = len(self.strategies)
        return -sum(c / total * math.log(c / total) for c in counts.values())

    def vocabulary(self) -> list[str]:
        """Every word that can appear in this family's x or y, sorted."""
        return sorted({*self._words(), *self.markers.values(), END})

    # ---- helpers ----------------------------------------------------------------------------------

    def _check_strategy(self, strategy: str) -> None:
        if strategy not in self.strategies:
            raise ValueError(
                f"strategy {strategy!r} is not a strategy of task {self.name!r}; "
                f"known: {list(self.strategies)}"
            )

    def _strategy_of_marker(self) -> dict[str, str]:
        return {marker: strategy for strategy, marker in self.markers.items()}

    def _bad_x(self, x: str, why: str) -> ValueError:
        return ValueError(f"x {x!r} is not a valid {self.name!r} input: {why}")

    # ---- per-family hooks -------------------------------------------------------------------------

    def _sample_x(self, rng: random.Random) -> str:
        raise NotImplementedError

    def _read_x(self, x: str):
        raise NotImplementedError

    def _render_body(self, parsed_x, strategy: str) -> list[str]:
        raise NotImplementedError

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        raise NotImplementedError

    def _answer(self, parsed_x) -> str:
        raise NotImplementedError

    def _words(self) -> set[str]:
        raise NotImplementedError


