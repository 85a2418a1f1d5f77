"""Synthetic multi-strategy tasks: inputs x that admit several procedures, each giving a different y.

Why these tasks: zcvae asks whether a latent z captures the *strategy* of a solution, so the
benchmark needs inputs with known, equally likely strategies whose outputs differ. Every family here
follows one layout so that the seed notes' picture (a strategy-sensitive prefix of t0 tokens, then a
near-deterministic suffix) holds exactly:

- y starts with a marker word that names the strategy, so t0 = 1: only the first y token is
  uncertain given x, and its irreducible NLL is log(number of strategies) = log 2 nats;
- the rest of y follows deterministically from (x, strategy);
- y ends with "." (and "." appears nowhere else), so a truncated y fails to parse;
- one strategy's trace is systematically longer, so `mean` and `sum` token aggregation differ;
- the strategy is drawn uniformly per example, independently of x (a 50/50 mixture).

Families (y length counts whitespace tokens of y only; means over 8,000 train examples, seed 0):

| family | strategies (marker) | x | mean y length | t0 |
|---|---|---|---|---|
| copy (default) | forward (`fwd`) / reverse (`rev`) | 4-7 digits | 7.5 / 14.0 | 1 |
| sort | direct (`sort`) / count (`count`) | 4-6 digits | 7.0 / 20.3 | 1 |
| add | direct (`sum`) / column (`col`) | two 2-4 digit numbers | 5.7 / 13.5 | 1 |
| search | bfs (`bfs`) / dfs (`dfs`) | a tree of 4-6 nodes and a target | 10.6 / 14.6 | 1 |

`copy` is the default: copying and reversing 4-7 digits are the easiest procedures for a 1M-parameter
model (attention to one position of x per step, no arithmetic), its sequences are the shortest, and
the reverse trace is twice as long as the forward one.

Late-decision families (``late_decision = True``): the first y words restate x, so every strategy
shares a prefix whose length varies with x, and the strategies part only at the *decision position*
(0-based y word index; with the built-in word-level tokenizer, also the y token index). There are
K = 3 strategies, the strategy is drawn uniformly, and `parse` tells the strategy from the word at
the decision position and checks the whole y against a re-render from the restated x:

| family | strategies | x | mean y length | decision position | ambiguity |
|---|---|---|---|---|---|
| sort3 | direct / count / descending | 3-5 digits | 10.0 / 21.1 / 15.0 | len(x) (3-5) | none |
| mul | direct / repeated / column | 'a * b', a of 2-4 digits, b in 1-4 | 10.5 / 16.4 / 16.5 | len(a) + 2 (4-6) | direct = repeated iff b = 1 |

`mul` is ambiguous by construction: when b = 1, repeated addition writes no "+ a" step and its y is
the direct y, so no encoder can tell them apart. b is drawn uniformly from 1-4, so 1/4 of the inputs
(and 1/4 x 2/3 = 1/6 of the examples) are ambiguous; `parse` names the first strategy in
`strategies` order ("direct") for such a y. `TaskFamily.decision_positions(x)` and
`TaskFamily.equivalent_strategies(x)` give both per input, for every family (the marker-first
families decide at position 0 and are never ambiguous). The figure `information_gain.png` marks them.

Examples (x -> y):
    copy   "3 1 4 1"        -> "fwd 3 1 4 1 ." | "rev 1 4 1 3 = 3 1 4 1 ."
    sort   "3 1 3 2"        -> "sort 1 2 3 3 ." | "count 1 * 1 2 * 1 3 * 2 = 1 2 3 3 ."
    add    "4 7 + 8 5"      -> "sum 1 3 2 ." | "col 2 c1 3 c1 = 1 3 2 ."
    search "a b a c b d ? d" -> "bfs a b c d = a b d ." | "dfs a b d b a c a = a b d ."
    sort3  "3 1 3 2"        -> "3 1 3 2 = 1 2 3 3 ." | "3 1 3 2 count 1 * 1 2 * 1 3 * 2 = 1 2 3 3 ."
                               | "3 1 3 2 rev 3 3 2 1 = 1 2 3 3 ."
    mul    "4 7 * 3"        -> "4 7 * 3 = 1 4 1 ." | "4 7 * 3 + 4 7 + 4 7 = 1 4 1 ." | "4 7 * 3 1 2 4 1 = 1 4 1 ."

Determinism: an example depends only on (task name, seed, split, index), through a SHA-256 hash that
seeds a `random.Random` (never Python's salted `hash()`). Splits hold disjoint inputs: every x is
assigned to exactly one split by a hash of (task name, x) (80% train, 10% val, 10% test), and the
generator redraws x until it lands in the requested split, so val/test scores measure unseen inputs.

Parsing (marker-first families): `parse(y)` never raises. `strategy` is the strategy named by the first word when it is a
known marker (even if the rest is malformed, so strategy purity can be scored on sloppy output);
`answer` is set only when `parse_ok`, i.e. the whole y is well formed and internally consistent
(e.g. a reverse trace must undo to the copy it claims). `answer(x)` is the strategy-independent
correct answer in the same format, so answer accuracy is `parse(y).answer == answer(x)`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

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


_FAILED = ParsedY(strategy=None, answer=None, parse_ok=False)


def _stable_seed(*parts: object) -> int:
    """A 64-bit integer from SHA-256 of the parts: identical across processes and Python versions."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def _is_digits(words: Sequence[str]) -> bool:
    return len(words) > 0 and all(w in DIGITS for w in words)


def _is_letters(words: Sequence[str]) -> bool:
    return len(words) > 0 and all(w in LETTERS for w in words)


def _split_once(words: Sequence[str], sep: str) -> tuple[list[str], list[str]] | None:
    """(left, right) around the only occurrence of sep, or None if sep occurs zero or several times."""
    if list(words).count(sep) != 1:
        return None
    cut = list(words).index(sep)
    return list(words[:cut]), list(words[cut + 1 :])


def _read_digits(task: "TaskFamily", x: str, *, max_len: int) -> list[str]:
    """x as a list of 1..max_len single digits (sort and sort3 read the same x); ValueError otherwise."""
    digits = x.split()
    if not _is_digits(digits) or len(digits) > max_len:
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
    # prefix (see the module docstring); False for the marker-first families (decision at 0).
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
            return _FAILED
        words = y.split()
        if not words:
            return _FAILED
        strategy = self._strategy_of_marker().get(words[0])
        if strategy is None:
            return _FAILED
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


class CopyTask(TaskFamily):
    """Copy a digit string, directly or by writing it reversed and then undoing the reversal."""

    name = "copy"
    strategies = ("forward", "reverse")
    markers = MappingProxyType({"forward": "fwd", "reverse": "rev"})
    description = (
        "x: 4-7 digits. forward: 'fwd' then x. reverse: 'rev', x reversed, '=', then x. "
        "Answer: x itself."
    )

    def _sample_x(self, rng: random.Random) -> str:
        return " ".join(rng.choice(DIGITS) for _ in range(rng.randint(4, 7)))

    def _read_x(self, x: str) -> list[str]:
        digits = x.split()
        if not _is_digits(digits):
            raise self._bad_x(x, "expected one or more single digits separated by spaces")
        return digits

    def _render_body(self, digits: list[str], strategy: str) -> list[str]:
        if strategy == "forward":
            return list(digits)
        return [*reversed(digits), "=", *digits]

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        if strategy == "forward":
            return " ".join(body) if _is_digits(body) else None
        parts = _split_once(body, "=")
        if parts is None:
            return None
        reversed_digits, digits = parts
        if not (_is_digits(reversed_digits) and _is_digits(digits)):
            return None
        if reversed_digits != digits[::-1]:
            return None
        return " ".join(digits)

    def _answer(self, digits: list[str]) -> str:
        return " ".join(digits)

    def _words(self) -> set[str]:
        return {*DIGITS, "="}


class SortTask(TaskFamily):
    """Sort digits ascending, directly or by a counting-sort trace (digit * count) first."""

    name = "sort"
    strategies = ("direct", "count")
    markers = MappingProxyType({"direct": "sort", "count": "count"})
    description = (
        "x: 4-6 digits. direct: 'sort' then the digits ascending. count: 'count', "
        "'d * c' for each distinct digit d (ascending) occurring c times, '=', then the digits "
        "ascending. Answer: the digits ascending."
    )
    # Counts are written as one digit, so an input may hold at most 9 digits.
    _MAX_LEN = 9

    def _sample_x(self, rng: random.Random) -> str:
        return " ".join(rng.choice(DIGITS) for _ in range(rng.randint(4, 6)))

    def _read_x(self, x: str) -> list[str]:
        return _read_digits(self, x, max_len=self._MAX_LEN)

    def _render_body(self, digits: list[str], strategy: str) -> list[str]:
        ascending = sorted(digits)
        if strategy == "direct":
            return ascending
        counts: list[str] = []
        for digit, count in sorted(Counter(digits).items()):
            counts += [digit, "*", str(count)]
        return [*counts, "=", *ascending]

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        if strategy == "direct":
            if not _is_digits(body) or body != sorted(body):
                return None
            return " ".join(body)
        parts = _split_once(body, "=")
        if parts is None:
            return None
        counts, ascending = parts
        if not counts or len(counts) % 3 != 0 or not _is_digits(ascending):
            return None
        expanded: list[str] = []
        previous = ""
        for i in range(0, len(counts), 3):
            digit, star, count = counts[i : i + 3]
            if digit not in DIGITS or star != "*" or count not in DIGITS[1:] or digit <= previous:
                return None
            expanded += [digit] * int(count)
            previous = digit
        if expanded != ascending:
            return None
        return " ".join(ascending)

    def _answer(self, digits: list[str]) -> str:
        return " ".join(sorted(digits))

    def _words(self) -> set[str]:
        return {*DIGITS, "*", "="}


class AddTask(TaskFamily):
    """Add two numbers, directly or column by column from the right with carries."""

    name = "add"
    strategies = ("direct", "column")
    markers = MappingProxyType({"direct": "sum", "column": "col"})
    description = (
        "x: two 2-4 digit numbers 'a + b' (digits most significant first). direct: 'sum' then "
        "the digits of a+b. column: 'col', for each column from the right its sum digit and carry "
        "(c0/c1), '=', then the digits of a+b. Answer: the digits of a+b."
    )

    def _sample_x(self, rng: random.Random) -> str:
        def number() -> str:
            num_digits = rng.randint(2, 4)
            return str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))

        return " ".join([*number(), "+", *number()])

    def _read_x(self, x: str) -> tuple[list[str], list[str]]:
        parts = _split_once(x.split(), "+")
        why = "expected 'a + b' with a and b written as single digits, no leading zeros"
        if parts is None:
            raise self._bad_x(x, why)
        for digits in parts:
            if not _is_digits(digits) or (len(digits) > 1 and digits[0] == "0"):
                raise self._bad_x(x, why)
        return parts

    @staticmethod
    def _sum_digits(a: list[str], b: list[str]) -> list[str]:
        return list(str(int("".join(a)) + int("".join(b))))

    def _render_body(self, parsed_x: tuple[list[str], list[str]], strategy: str) -> list[str]:
        a, b = parsed_x
        total = self._sum_digits(a, b)
        if strategy == "direct":
            return total
        columns: list[str] = []
        carry = 0
        a_rev, b_rev = a[::-1], b[::-1]
        for i in range(max(len(a), len(b))):
            column = carry + (int(a_rev[i]) if i < len(a) else 0) + (int(b_rev[i]) if i < len(b) else 0)
            carry = column // 10
            columns += [str(column % 10), f"c{carry}"]
        return [*columns, "=", *total]

    @staticmethod
    def _is_number(digits: list[str]) -> bool:
        return _is_digits(digits) and (len(digits) == 1 or digits[0] != "0")

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        if strategy == "direct":
            return " ".join(body) if self._is_number(body) else None
        parts = _split_once(body, "=")
        if parts is None:
            return None
        columns, total = parts
        if not columns or len(columns) % 2 != 0 or not self._is_number(total):
            return None
        column_digits = columns[0::2]
        carries = columns[1::2]
        if not _is_digits(column_digits) or any(c not in ("c0", "c1") for c in carries):
            return None
        # The total must be the column digits read right to left, led by the final carry if any.
        expected = (["1"] if carries[-1] == "c1" else []) + column_digits[::-1]
        if expected != total:
            return None
        return " ".join(total)

    def _answer(self, parsed_x: tuple[list[str], list[str]]) -> str:
        return " ".join(self._sum_digits(*parsed_x))

    def _words(self) -> set[str]:
        return {*DIGITS, "+", "=", "c0", "c1"}


@dataclass(frozen=True)
class _Tree:
    root: str
    children: dict[str, list[str]]
    parent: dict[str, str]
    target: str


class SearchTask(TaskFamily):
    """Find the root-to-target path in a tree after a full breadth-first or depth-first traversal."""

    name = "search"
    strategies = ("bfs", "dfs")
    markers = MappingProxyType({"bfs": "bfs", "dfs": "dfs"})
    description = (
        "x: the edges 'parent child' of a tree of 4-6 nodes (letters a-h; the first parent is "
        "the root; children are visited in the order listed), then '? t' naming a target. "
        "bfs: 'bfs', the breadth-first order, '=', the root-to-target path. dfs: 'dfs', the "
        "depth-first walk writing a node again on every return to it (2n-1 nodes), '=', the path. "
        "Answer: the root-to-target path."
    )

    def _sample_x(self, rng: random.Random) -> str:
        nodes = rng.sample(LETTERS, rng.randint(4, 6))
        edges: list[str] = []
        for i in range(1, len(nodes)):
            edges += [nodes[rng.randrange(i)], nodes[i]]
        return " ".join([*edges, "?", rng.choice(nodes[1:])])

    def _read_x(self, x: str) -> _Tree:
        words = x.split()
        why = "expected 'parent child' letter pairs (a-h) forming a tree, then '? target'"
        if len(words) < 4 or len(words) % 2 != 0 or words[-2] != "?" or not _is_letters(words[:-2] + words[-1:]):
            raise self._bad_x(x, why)
        edges = words[:-2]
        root = edges[0]
        children: dict[str, list[str]] = {root: []}
        parent: dict[str, str] = {}
        for i in range(0, len(edges), 2):
            p, c = edges[i], edges[i + 1]
            if p not in children or c in children:
                raise self._bad_x(x, why + f" (edge {p} {c} does not extend the tree)")
            children[p].append(c)
            children[c] = []
            parent[c] = p
        target = words[-1]
        if target not in children:
            raise self._bad_x(x, why + f" (target {target} is not in the tree)")
        return _Tree(root=root, children=children, parent=parent, target=target)

    @staticmethod
    def _path(tree: _Tree) -> list[str]:
        path = [tree.target]
        while path[-1] != tree.root:
            path.append(tree.parent[path[-1]])
        return path[::-1]

    def _render_body(self, tree: _Tree, strategy: str) -> list[str]:
        if strategy == "bfs":
            order = [tree.root]
            for node in order:  # the list grows while we walk it: a queue
                order += tree.children[node]
        else:
            order = []

            def walk(node: str) -> None:
                order.append(node)
                for child in tree.children[node]:
                    walk(child)
                    order.append(node)

            walk(tree.root)
        return [*order, "=", *self._path(tree)]

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        parts = _split_once(body, "=")
        if parts is None:
            return None
        order, path = parts
        if not (_is_letters(order) and _is_letters(path)) or len(set(path)) != len(path):
            return None
        if path[0] != order[0]:
            return None
        if strategy == "bfs":
            if len(set(order)) != len(order) or not set(path) <= set(order):
                return None
            # Along a root-to-node path each node is discovered after its parent.
            positions = [order.index(node) for node in path]
            if positions != sorted(positions):
                return None
            return " ".join(path)
        # dfs: replay the walk with a stack; each step goes down to a new node or back to the parent.
        stack = [order[0]]
        parent: dict[str, str] = {}
        for node in order[1:]:
            if len(stack) >= 2 and node == stack[-2]:
                stack.pop()
            elif node not in parent and node != order[0]:
                parent[node] = stack[-1]
                stack.append(node)
            else:
                return None
        if stack != [order[0]]:
            return None
        if any(parent.get(child) != p for p, child in zip(path, path[1:])):
            return None
        return " ".join(path)

    def _answer(self, tree: _Tree) -> str:
        return " ".join(self._path(tree))

    def _words(self) -> set[str]:
        return {*LETTERS, "?", "="}


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
            return _FAILED
        words = y.split()
        split = self._split_restated(words)
        if split is None:
            return _FAILED
        x_words, position = split
        strategy = self._strategy_at(words[position]) if position < len(words) else None
        if strategy is None:
            return _FAILED
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
        return _read_digits(self, x, max_len=self._MAX_LEN)

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
        if not _is_digits(a) or (len(a) > 1 and a[0] == "0"):
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


TASKS: Mapping[str, TaskFamily] = MappingProxyType(
    {task.name: task for task in (CopyTask(), SortTask(), AddTask(), SearchTask(), Sort3Task(), MulTask())}
)
DEFAULT_TASK = "copy"


def get_task(name: str | TaskFamily) -> TaskFamily:
    """The built-in task family called `name` (a TaskFamily passes through). ValueError if unknown."""
    if isinstance(name, TaskFamily):
        return name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]


def make_examples(task: str | TaskFamily, *, seed: int, split: str, num_examples: int) -> list[Example]:
    """Examples 0 .. num_examples-1 of `split`; each is independent of num_examples (a prefix is stable)."""
    family = get_task(task)
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    return [family.example(seed=seed, split=split, index=i) for i in range(num_examples)]
