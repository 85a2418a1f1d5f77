"""The synthetic multi-strategy tasks: parsers, determinism, strategy signal, vocabulary coverage."""

import math
import random
import statistics

import pytest

from zcvae.data import DEFAULT_TASK, SPLITS, TASKS, Example, ParsedY, TaskFamily, build_tokenizer, get_task, make_examples

NUM_EXAMPLES = 200  # per task, split and strategy: every length and many shapes of x

TASK_NAMES = sorted(TASKS)
# Families whose first y word names the strategy (t0 = 1); the late-decision ones are tested below.
MARKER_FIRST = sorted(name for name, task in TASKS.items() if not task.late_decision)
LATE = sorted(name for name, task in TASKS.items() if task.late_decision)


@pytest.fixture(scope="module")
def generated():
    """{task name: examples} with both strategies forced for the same x (index i -> two examples)."""
    out = {}
    for name, task in TASKS.items():
        examples = []
        for split in SPLITS:
            for index in range(NUM_EXAMPLES):
                for strategy in task.strategies:
                    examples.append(task.example(seed=7, split=split, index=index, strategy=strategy))
        out[name] = examples
    return out


def test_registry_and_default():
    assert len(TASKS) >= 3
    assert {"sort3", "mul"} <= set(LATE)
    assert DEFAULT_TASK in TASKS
    for name, task in TASKS.items():
        assert isinstance(task, TaskFamily)
        assert task.name == name
        assert len(task.strategies) >= 2
        assert task.description
        assert get_task(name) is task
    with pytest.raises(ValueError, match="known tasks.*copy"):
        get_task("no-such-task")


@pytest.mark.parametrize("name", MARKER_FIRST)
def test_parse_round_trips_every_gold_y(name, generated):
    task = TASKS[name]
    for example in generated[name]:
        parsed = task.parse(example.y)
        assert parsed == ParsedY(strategy=example.strategy, answer=task.answer(example.x), parse_ok=True), example


@pytest.mark.parametrize("name", TASK_NAMES)
def test_sequences_are_short_and_x_independent_of_strategy(name, generated):
    task = TASKS[name]
    by_id: dict[str, set[str]] = {}
    for example in generated[name]:
        assert 1 <= len(example.x.split()) <= 12
        assert 2 <= len(example.y.split()) <= 30
        by_id.setdefault(example.id, set()).add(example.x)
    assert all(len(xs) == 1 for xs in by_id.values())
    assert task.example(seed=3, split="train", index=5).x == task.example(
        seed=3, split="train", index=5, strategy=task.strategies[-1]
    ).x


@pytest.mark.parametrize("name", MARKER_FIRST)
def test_strategies_differ_within_first_two_tokens(name):
    task = TASKS[name]
    for index in range(200):
        ys = [task.example(seed=1, split="train", index=index, strategy=s).y.split() for s in task.strategies]
        # Every pair of strategies already differs within the first two y tokens (t0 <= 2).
        assert len({tuple(y[:2]) for y in ys}) == len(ys)
        # Only the first token is strategy-dependent: the same strategy always renders the same y.
        x = task.example(seed=1, split="train", index=index).x
        assert [task.render(x, s).split() for s in task.strategies] == ys


@pytest.mark.parametrize("name", MARKER_FIRST)
def test_strategy_is_a_uniform_mixture_and_lengths_correlate(name):
    task = TASKS[name]
    examples = make_examples(task, seed=0, split="train", num_examples=1000)
    counts = {s: sum(e.strategy == s for e in examples) for s in task.strategies}
    # Binomial(1000, 1/2): 5 standard deviations is about +-80.
    assert all(abs(c - 1000 / len(task.strategies)) < 80 for c in counts.values()), counts
    mean_lengths = [statistics.mean(len(e.y.split()) for e in examples if e.strategy == s) for s in task.strategies]
    assert max(mean_lengths) > 1.3 * min(mean_lengths), mean_lengths
    assert len({len(e.y.split()) for e in examples}) >= 4  # lengths vary within the task too


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generation_is_deterministic_and_splits_differ(name):
    task = TASKS[name]
    first = make_examples(task, seed=11, split="train", num_examples=50)
    again = make_examples(name, seed=11, split="train", num_examples=50)
    assert first == again
    assert make_examples(task, seed=11, split="train", num_examples=10) == first[:10]
    assert first[3].id == f"{name}-train-11-3"
    other_seed = make_examples(task, seed=12, split="train", num_examples=50)
    assert sum(a.x != b.x for a, b in zip(first, other_seed)) >= 40
    xs_by_split = {split: {e.x for e in make_examples(task, seed=11, split=split, num_examples=200)} for split in SPLITS}
    # Splits hold disjoint inputs, decided by a hash of x.
    assert not xs_by_split["train"] & xs_by_split["val"]
    assert not xs_by_split["train"] & xs_by_split["test"]
    assert not xs_by_split["val"] & xs_by_split["test"]
    for split, xs in xs_by_split.items():
        assert all(task.split_of(x) == split for x in xs)


def test_generation_does_not_use_python_hash():
    """A fixed example pins the hash-seeded stream, so a salted hash() or changed seeding would show."""
    task = get_task("copy")
    examples = [task.example(seed=0, split="train", index=i) for i in range(3)]
    assert [e.strategy for e in examples] == [e.strategy for e in make_examples("copy", seed=0, split="train", num_examples=3)]
    # Recompute in a fresh interpreter with a different PYTHONHASHSEED: must agree.
    import os
    import subprocess
    import sys

    code = (
        "from zcvae.data import make_examples;"
        "print([(e.x, e.y) for e in make_examples('copy', seed=0, split='train', num_examples=3)])"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([(e.x, e.y) for e in examples])


def test_example_rejects_bad_arguments():
    task = get_task(DEFAULT_TASK)
    with pytest.raises(ValueError, match="split"):
        task.example(seed=0, split="dev", index=0)
    with pytest.raises(ValueError, match="index"):
        task.example(seed=0, split="train", index=-1)
    with pytest.raises(ValueError, match="seed"):
        task.example(seed="0", split="train", index=0)
    with pytest.raises(ValueError, match="strategy 'sideways'.*known"):
        task.example(seed=0, split="train", index=0, strategy="sideways")
    with pytest.raises(ValueError, match="strategy"):
        task.render("1 2 3", "sideways")
    with pytest.raises(ValueError, match="num_examples"):
        make_examples(task, seed=0, split="train", num_examples=-1)


@pytest.mark.parametrize(
    "name, bad_x",
    [
        ("copy", ""),
        ("copy", "1 2 a"),
        ("copy", "12 3"),
        ("sort", "1 2 3 4 5 6 7 8 9 0"),
        ("add", "1 2 3"),
        ("add", "0 1 + 2"),
        ("add", "1 + 2 + 3"),
        ("search", "a b"),
        ("search", "a b c d ? d"),
        ("search", "a b a b ? b"),
        ("search", "a b ? c"),
    ],
)
def test_malformed_x_is_a_clear_error(name, bad_x):
    task = TASKS[name]
    with pytest.raises(ValueError, match="not a valid"):
        task.answer(bad_x)
    with pytest.raises(ValueError, match="not a valid"):
        task.render(bad_x, task.strategies[0])


def test_known_renders():
    """Hand-checked y for each family (the docstring examples)."""
    cases = {
        ("copy", "3 1 4 1"): ["fwd 3 1 4 1 .", "rev 1 4 1 3 = 3 1 4 1 ."],
        ("sort", "3 1 3 2"): ["sort 1 2 3 3 .", "count 1 * 1 2 * 1 3 * 2 = 1 2 3 3 ."],
        ("add", "4 7 + 8 5"): ["sum 1 3 2 .", "col 2 c1 3 c1 = 1 3 2 ."],
        ("add", "9 9 9 + 1 2"): ["sum 1 0 1 1 .", "col 1 c1 1 c1 0 c1 = 1 0 1 1 ."],
        ("search", "a b a c b d ? d"): ["bfs a b c d = a b d .", "dfs a b d b a c a = a b d ."],
    }
    for (name, x), ys in cases.items():
        task = TASKS[name]
        assert [task.render(x, s) for s in task.strategies] == ys
        assert all(task.parse(y).answer == task.answer(x) for y in ys)


def _corruptions(task: TaskFamily, example: Example) -> list[str]:
    """Texts that must not parse: every truncation, and the body under another strategy's marker."""
    words = example.y.split()
    out = [" ".join(words[:cut]) for cut in range(len(words))]  # every strict prefix
    for strategy in task.strategies:
        if strategy != example.strategy:
            out.append(" ".join([task.markers[strategy], *words[1:]]))
    return out


@pytest.mark.parametrize("name", MARKER_FIRST)
def test_parse_rejects_truncated_and_cross_strategy_text(name, generated):
    task = TASKS[name]
    for example in generated[name][:300]:
        for text in _corruptions(task, example):
            parsed = task.parse(text)
            assert parsed.parse_ok is False and parsed.answer is None, (example, text)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_parse_never_raises_on_garbage(name):
    task = TASKS[name]
    rng = random.Random(1)
    tokenizer = build_tokenizer()
    vocabulary = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    texts = ["", "   ", ".", "\n\t", "fwd", "rev =", "?? !!", "é ü 中文", "1" * 50, None, 3, b"fwd 1 ."]
    markers = list(task.markers.values()) or vocabulary  # late-decision families have no first-word marker
    for _ in range(3000):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(0, 20))]
        if rng.random() < 0.7:
            words = [rng.choice(markers), *words, "."]
        texts.append(" ".join(words))
    num_ok = 0
    for text in texts:
        parsed = task.parse(text)
        assert isinstance(parsed, ParsedY)
        assert parsed.parse_ok == (parsed.answer is not None)
        if parsed.parse_ok:
            num_ok += 1
            assert parsed.strategy in task.strategies
    assert num_ok < 100  # random words almost never form a consistent trace


def test_parse_reports_marker_strategy_even_when_malformed():
    task = get_task("copy")
    assert task.parse("rev 1 2 = 1 2 .") == ParsedY(strategy="reverse", answer=None, parse_ok=False)
    assert task.parse("fwd 1 x .") == ParsedY(strategy="forward", answer=None, parse_ok=False)
    assert task.parse("fwd 1 2 . 3 .").parse_ok is False
    assert task.parse("zzz 1 2 .") == ParsedY(strategy=None, answer=None, parse_ok=False)
    # Changing one digit of a consistent trace breaks its self-check.
    assert task.parse("rev 2 1 = 1 3 .").parse_ok is False
    assert get_task("add").parse("col 2 c1 3 c0 = 1 3 2 .").parse_ok is False
    assert get_task("sort").parse("count 1 * 2 = 1 .").parse_ok is False
    assert get_task("sort").parse("sort 2 1 .").parse_ok is False
    assert get_task("search").parse("dfs a b c a = a b .").parse_ok is False


def test_every_generated_word_is_in_the_tokenizer_vocabulary(generated):
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    for name, examples in generated.items():
        assert set(TASKS[name].vocabulary()) <= set(vocab)
        texts = [text for example in examples for text in (example.x, example.y)]
        for text in texts:
            assert all(word in vocab for word in text.split()), (name, text)
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        assert all(len(ids) == len(text.split()) for ids, text in zip(encoded, texts))
        assert tokenizer.unk_token_id not in {token_id for ids in encoded for token_id in ids}


# ---------------------------------------------------------------- late-decision families


@pytest.mark.parametrize("name", LATE)
def test_late_parse_round_trips_every_gold_y(name, generated):
    task = TASKS[name]
    for example in generated[name]:
        parsed = task.parse(example.y)
        assert parsed.parse_ok and parsed.answer == task.answer(example.x), example
        # The named strategy is the gold one, or (ambiguous y) one that renders the very same y.
        assert parsed.strategy == example.strategy or task.render(example.x, parsed.strategy) == example.y, example
        assert parsed.strategy == next(s for s in task.strategies if task.render(example.x, s) == example.y)


@pytest.mark.parametrize("name", LATE)
def test_late_families_share_a_prefix_and_decide_at_the_documented_position(name, generated):
    task = TASKS[name]
    assert len(task.strategies) >= 3
    positions = set()
    for example in generated[name][:: len(task.strategies)]:
        ys = [task.render(example.x, s).split() for s in task.strategies]
        (position,) = task.decision_positions(example.x)
        # sort3: after the digits of x; mul: after 'a * b'. Either way, right after the restated x.
        assert position == len(example.x.split()), example
        assert position >= 3
        assert all(y[:position] == example.x.split() for y in ys)  # the shared prefix restates x
        distinct = {tuple(y) for y in ys}
        assert len({y[position] for y in distinct}) == len(distinct)  # distinct ys part right there
        positions.add(position)
    assert len(positions) >= 2  # the decision point varies by example


def test_late_parse_rejects_truncations_and_swapped_decision_words(generated):
    for name in LATE:
        task = TASKS[name]
        for example in generated[name][:300]:
            words = example.y.split()
            for cut in range(len(words)):
                assert task.parse(" ".join(words[:cut])).parse_ok is False, (example, cut)
            (position,) = task.decision_positions(example.x)
            for other in task.strategies:
                swapped = task.render(example.x, other).split()[position]
                if swapped != words[position]:
                    text = " ".join([*words[:position], swapped, *words[position + 1 :]])
                    assert task.parse(text).parse_ok is False, (example, text)


def test_known_late_renders_and_marker_first_decision_positions():
    assert [TASKS["sort3"].render("3 1 3 2", s) for s in TASKS["sort3"].strategies] == [
        "3 1 3 2 = 1 2 3 3 .", "3 1 3 2 count 1 * 1 2 * 1 3 * 2 = 1 2 3 3 .", "3 1 3 2 rev 3 3 2 1 = 1 2 3 3 .",
    ]
    assert [TASKS["mul"].render("4 7 * 3", s) for s in TASKS["mul"].strategies] == [
        "4 7 * 3 = 1 4 1 .", "4 7 * 3 + 4 7 + 4 7 = 1 4 1 .", "4 7 * 3 1 2 4 1 = 1 4 1 .",
    ]
    assert TASKS["mul"].render("4 7 * 1", "repeated") == TASKS["mul"].render("4 7 * 1", "direct") == "4 7 * 1 = 4 7 ."
    for name in MARKER_FIRST:
        x = TASKS[name].example(seed=0, split="train", index=0).x
        assert TASKS[name].decision_positions(x) == (0,)
        assert TASKS[name].equivalent_strategies(x) == []


def test_mul_ambiguity_is_exactly_b_equal_one_at_the_documented_rate():
    task = TASKS["mul"]
    examples = make_examples(task, seed=0, split="train", num_examples=4000)
    ambiguous = 0
    for example in examples:
        b = int(example.x.split()[-1])
        groups = task.equivalent_strategies(example.x)
        assert groups == ([("direct", "repeated")] if b == 1 else []), example
        ambiguous += b == 1
    # Documented: 1/4 of the inputs. Binomial(4000, 1/4): 5 standard deviations is about 0.034.
    assert abs(ambiguous / len(examples) - 0.25) < 0.034
    assert "1/4" in task.ambiguity and "1/6" in task.ambiguity
    for name in ("sort3",):
        assert all(TASKS[name].equivalent_strategies(e.x) == [] for e in make_examples(name, seed=0, split="val", num_examples=500))


def test_late_families_keep_the_tokenizer_vocabulary_unchanged():
    # Their words are words of the marker-first families, so adding them shifted no token id (a
    # cached built-in backbone of copy/sort/add/search is still valid) and nothing maps to <unk>.
    old_words = {w for name in MARKER_FIRST for w in TASKS[name].vocabulary()}
    for name in LATE:
        assert set(TASKS[name].vocabulary()) <= old_words


def test_y_entropy_is_log_s_unless_strategies_coincide():
    # mul with b = 1: direct and repeated render one y, so y takes two values with 2/3 and 1/3.
    assert TASKS["mul"].y_entropy("4 2 * 1") == pytest.approx(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3))
    assert TASKS["mul"].y_entropy("4 2 * 3") == pytest.approx(math.log(3))
    assert TASKS["sort3"].y_entropy("3 1 2") == pytest.approx(math.log(3))
    assert TASKS["copy"].y_entropy("3 1 4") == pytest.approx(math.log(2))
