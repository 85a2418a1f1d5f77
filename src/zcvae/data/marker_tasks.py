"""The marker-first task families: copy, sort, add, search (y starts with a word naming the strategy).

Their strategies, x formats, y lengths and examples are tabled in ``zcvae.data.tasks``; the protocol
they implement is ``zcvae.data.task_family.TaskFamily``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType

from zcvae.data.task_family import (
    DIGITS,
    LETTERS,
    TaskFamily,
    is_digits,
    is_letters,
    read_digits,
    split_once,
)

__all__ = ["AddTask", "CopyTask", "SearchTask", "SortTask"]


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
        if not is_digits(digits):
            raise self._bad_x(x, "expected one or more single digits separated by spaces")
        return digits

    def _render_body(self, digits: list[str], strategy: str) -> list[str]:
        if strategy == "forward":
            return list(digits)
        return [*reversed(digits), "=", *digits]

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        if strategy == "forward":
            return " ".join(body) if is_digits(body) else None
        parts = split_once(body, "=")
        if parts is None:
            return None
        reversed_digits, digits = parts
        if not (is_digits(reversed_digits) and is_digits(digits)):
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
        return read_digits(self, x, max_len=self._MAX_LEN)

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
            if not is_digits(body) or body != sorted(body):
                return None
            return " ".join(body)
        parts = split_once(body, "=")
        if parts is None:
            return None
        counts, ascending = parts
        if not counts or len(counts) % 3 != 0 or not is_digits(ascending):
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
        parts = split_once(x.split(), "+")
        why = "expected 'a + b' with a and b written as single digits, no leading zeros"
        if parts is None:
            raise self._bad_x(x, why)
        for digits in parts:
            if not is_digits(digits) or (len(digits) > 1 and digits[0] == "0"):
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
        return is_digits(digits) and (len(digits) == 1 or digits[0] != "0")

    def _parse_body(self, body: list[str], strategy: str) -> str | None:
        if strategy == "direct":
            return " ".join(body) if self._is_number(body) else None
        parts = split_once(body, "=")
        if parts is None:
            return None
        columns, total = parts
        if not columns or len(columns) % 2 != 0 or not self._is_number(total):
            return None
        column_digits = columns[0::2]
        carries = columns[1::2]
        if not is_digits(column_digits) or any(c not in ("c0", "c1") for c in carries):
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
        if len(words) < 4 or len(words) % 2 != 0 or words[-2] != "?" or not is_letters(words[:-2] + words[-1:]):
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
        parts = split_once(body, "=")
        if parts is None:
            return None
        order, path = parts
        if not (is_letters(order) and is_letters(path)) or len(set(path)) != len(path):
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
