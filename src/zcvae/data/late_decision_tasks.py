"""The late-decision task families: sort3 and mul (y restates x, and the strategies part only after it).

Their strategies, decision positions, ambiguity and examples are tabled in ``zcvae.data.tasks``; the
protocol they implement is ``zcvae.data.task_family.TaskFamily``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

from zcvae.data.task_family import DIGITS, END, FAILED, ParsedY, TaskFamily, is_digits, read_digits

__all__ = ["MulTask", "Sort3Task"]


class _LateDecisionTask(TaskFamily):
    """y = the words of x restated, then the strategy's trace: the strategies share that prefix.

    Subclasses implement `_split_restated(words) -> (x words, decision position) | None` and
    `_strategy_at(word)`. `parse` reads the restated x, names the strategy from the word at the
    decision position, and accepts y only if it equals `render(restated x, strategy)`, so a parsed y
    is always self-consistent and its answer is that of the restated x.
    """

    late_decision = True
    markers: Mapping[str, str] = MappingProxyType({})

    def render(self, x: str, strategy: str) -> str:
        self._check_strategy(strategy)
        parsed_x = self._read_x(x)
        return " ".join([*x.split(), *self._render_body(parsed_x, strategy), END])

    def parse(self, y: str) -> ParsedY:
        if not isinstance(y, str):
            return FAILED
        words = y.split()
        split = self._split_restated(words)
        if split is None:
            return FAILED
        x_words, position = split
        strategy = self._strategy_at(words[position]) if position < len(words) else None
        if strategy is None:
            return FAILED
        x = " ".join(x_words)
        try:
            ok = self.render(x, strategy).split() == words
        except ValueError:  # the restated x is not a valid input
            ok = False
        if not ok:
            # An ambiguous y (two strategies, one text) parses as the first strategy that renders it.
            return ParsedY(strategy=strategy, answer=None, parse_ok=False)
        return ParsedY(strategy=strategy, answer=self.answer(x), parse_ok=True)

    def _split_restated(self, words: list[str]) -> tuple[list[str], int] | None:
        raise NotImplementedError

    def _strategy_at(self, word: str) -> str | None:
        raise NotImplementedError


class Sort3Task(_LateDecisionTask):
    """Sort digits ascending after restating them: directly, by counting, or descending then reversed."""

    name = "sort3"
    strategies = ("direct", "count", "descending")
    description = (
        "x: 3-5 digits. y restates x, then: direct: '=' and the digits ascending; count: 'count', "
        "'d * c' for each distinct digit d (ascending) occurring c times, '=', the digits ascending; "
        "descending: 'rev', the digits descending, '=', the digits ascending. Decision position: "
        "len(x). Answer: the digits ascending."
    )
    _MAX_LEN = 9  # counts are one digit
    _DECISION_WORDS = MappingProxyType({"=": "direct", "count": "count", "rev": "descending"})

    def _sample_x(self, rng: random.Random) -> str:
        return " ".join(rng.choice(DIGITS) for _ in range(rng.randint(3, 5)))

    def _read_x(self, x: str) -> list[str]:
        return read_digits(self, x, max_len=self._MAX_LEN)

    def _render_body(self, digits: list[str], strategy: str) -> list[str]:
        ascending = sorted(digits)
        if strategy == "direct":
            return ["=", *ascending]
        if strategy == "count":
            counts: list[str] = []
            for digit, count in sorted(Counter(digits).items()):
                counts += [digit, "*", str(count)]
            return ["count", *counts, "=", *ascending]
        return ["rev", *sorted(digits, reverse=True), "=", *ascending]

    def _split_restated(self, words: list[str]) -> tuple[list[str], int] | None:
        cut = next((i for i, w in enumerate(words) if w not in DIGITS), len(words))
        return (words[:cut], cut) if cut > 0 else None

    def _strategy_at(self, word: str) -> str | None:
        return self._DECISION_WORDS.get(word)

    def _answer(self, digits: list[str]) -> str:
        return " ".join(sorted(digits))

    def _words(self) -> set[str]:
        return {*DIGITS, "*", "=", "count", "rev"}


class MulTask(_LateDecisionTask):
    """Multiply a number by a digit after restating them: directly, by repeated addition, or by columns."""

    name = "mul"
    strategies = ("direct", "repeated", "column")
    description = (
        "x: 'a * b', a of 2-4 digits (no leading zero), b a digit 1-4. y restates x, then: direct: "
        "'=' and the digits of a*b; repeated: '+ a' written b-1 times, '=', the digits of a*b; column: "
        "for each digit of a from the right, the digit and the carry (one digit) of digit*b + carry, "
        "'=', the digits of a*b. Decision position: len(a) + 2. Answer: the digits of a*b."
    )
    ambiguity = (
        "direct and repeated give the same y exactly when b = 1 (no '+ a' step): 1/4 of the inputs "
        "(b uniform in 1-4), 1/6 of the examples; parse names 'direct' for that y"
    )

    def _sample_x(self, rng: random.Random) -> str:
        num_digits = rng.randint(2, 4)
        a = str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))
        return " ".join([*a, "*", str(rng.randint(1, 4))])

    def _read_x(self, x: str) -> tuple[list[str], int]:
        words = x.split()
        why = "expected 'a * b' with a written as single digits (no leading zero) and b a digit 1-9"
        if len(words) < 3 or words[-2] != "*" or words[-1] not in DIGITS[1:]:
            raise self._bad_x(x, why)
        a = words[:-2]
        if not is_digits(a) or (len(a) > 1 and a[0] == "0"):
            raise self._bad_x(x, why)
        return a, int(words[-1])

    def _render_body(self, parsed_x: tuple[list[str], int], strategy: str) -> list[str]:
        a, b = parsed_x
        product = list(str(int("".join(a)) * b))
        if strategy == "direct":
            return ["=", *product]
        if strategy == "repeated":
            return [*(["+", *a] * (b - 1)), "=", *product]
        columns: list[str] = []
        carry = 0
        for digit in reversed(a):
            column = int(digit) * b + carry
            carry = column // 10
            columns += [str(column % 10), str(carry)]
        return [*columns, "=", *product]

    def _split_restated(self, words: list[str]) -> tuple[list[str], int] | None:
        if "*" not in words:
            return None
        star = words.index("*")
        if star + 1 >= len(words):
            return None
        return words[: star + 2], star + 2

    def _strategy_at(self, word: str) -> str | None:
        if word == "=":
            return "direct"
        if word == "+":
            return "repeated"
        return "column" if word in DIGITS else None

    def _answer(self, parsed_x: tuple[list[str], int]) -> str:
        a, b = parsed_x
        return " ".join(str(int("".join(a)) * b))

    def _words(self) -> set[str]:
        return {*DIGITS, "*", "+", "="}
