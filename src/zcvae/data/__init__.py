"""Synthetic multi-strategy tasks, JSONL datasets and the word-level tokenizer.

Built-in task families (details, per-strategy y lengths and examples in `zcvae.data.tasks`). In the
first four every y starts with a strategy marker (t0 = 1 token), continues deterministically and ends
with "."; the late-decision families restate x first and part after that shared prefix:

| family | strategies | mean y length (tokens) per strategy |
|---|---|---|
| copy (DEFAULT_TASK) | forward / reverse | 7.5 / 14.0 |
| sort | direct / count | 7.0 / 20.3 |
| add | direct / column | 5.7 / 13.5 |
| search | bfs / dfs | 10.6 / 14.6 |
| sort3 (late: decides after x, 3-5 tokens) | direct / count / descending | 10.0 / 21.1 / 15.0 |
| mul (late: after 'a * b', 4-6 tokens; direct = repeated iff b = 1) | direct / repeated / column | 10.5 / 16.4 / 16.5 |
"""

from zcvae.data.jsonl import read_jsonl, write_jsonl
from zcvae.data.tasks import (
    DEFAULT_TASK,
    SPLITS,
    TASKS,
    Example,
    ParsedY,
    TaskFamily,
    get_task,
    make_examples,
)
from zcvae.data.tokenizer import SPECIAL_TOKENS, TEMPLATE_TOKENS, build_tokenizer

__all__ = [
    "DEFAULT_TASK",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TASKS",
    "TEMPLATE_TOKENS",
    "Example",
    "ParsedY",
    "TaskFamily",
    "build_tokenizer",
    "get_task",
    "make_examples",
    "read_jsonl",
    "write_jsonl",
]
