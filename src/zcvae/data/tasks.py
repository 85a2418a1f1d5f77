"""Synthetic multi-strategy tasks: inputs x that admit several procedures, each giving a different y.

Why these tasks: zcvae asks whether a latent z captures the *strategy* of a solution, so the
benchmark needs inputs with known, equally likely strategies whose outputs differ. Every family here
follows one layout so that the picture of docs/objective.md#dilution (a strategy-sensitive prefix of
t0 tokens, then a near-deterministic suffix) holds exactly:

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

Layout: this module is the registry (``TASKS``, ``get_task``, ``make_examples``); the protocol is
``zcvae.data.task_family``, the families are in ``zcvae.data.marker_tasks`` and
``zcvae.data.late_decision_tasks``. Their public names are re-exported here, so ``zcvae.data.tasks``
stays the one import path.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from zcvae.data.late_decision_tasks import MulTask, Sort3Task
from zcvae.data.marker_tasks import AddTask, CopyTask, SearchTask, SortTask
from zcvae.data.task_family import DIGITS, END, LETTERS, SPLITS, Example, ParsedY, TaskFamily

__all__ = [
    "DEFAULT_TASK",
    "DIGITS",
    "END",
    "LETTERS",
    "SPLITS",
    "TASKS",
    "AddTask",
    "CopyTask",
    "Example",
    "MulTask",
    "ParsedY",
    "SearchTask",
    "Sort3Task",
    "SortTask",
    "TaskFamily",
    "get_task",
    "make_examples",
]

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
