"""The user-data families of examples/families/: the generator reproduces the shipped JSONL byte for byte,
each strategy is a deterministic map, the families have the structure they claim (where strategies
decide, which rows are ambiguous), and the reachable NMI examples/families/README.md states is what zcvae's evaluator
computes from the val file alone."""

import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

from zcvae.data import read_jsonl
from zcvae.eval.metrics import reachable_nmi

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "families"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("example_families_generate", EXAMPLES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped(gen):
    return {(f, s): read_jsonl(EXAMPLES / gen.file_name(f, s)) for f in gen.FAMILIES for s in ("train", "val")}


def test_generator_reproduces_the_shipped_files_byte_for_byte(gen, tmp_path):
    assert gen.main(["--output-dir", str(tmp_path)]) == 0
    for family in gen.FAMILIES:
        for split in ("train", "val"):
            name = gen.file_name(family, split)
            assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), name


def test_each_strategy_maps_x_to_one_y_and_splits_hold_disjoint_inputs(gen, shipped):
    for family in gen.FAMILIES:
        train, val = shipped[family, "train"], shipped[family, "val"]
        ys = defaultdict(set)
        for e in train + val:
            ys[e.x, e.strategy].add(e.y)
        assert all(len(y) == 1 for y in ys.values())
        assert {e.strategy for e in train} == set(gen.STRATEGIES[family]) and len(gen.STRATEGIES[family]) >= 3
        assert not {e.x for e in train} & {e.x for e in val}
        # val: every input once under every strategy, so repeated (x, y) pairs expose any ambiguity
        by_x = defaultdict(list)
        for e in val:
            by_x[e.x].append(e.strategy)
        assert all(strategies == list(gen.STRATEGIES[family]) for strategies in by_x.values())


def _first_difference(a, b):
    a, b = a.split(), b.split()
    return next((t for t, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))


def test_late_family_decides_at_the_first_token_for_reverse_and_after_x_for_the_others(shipped):
    val = shipped["late", "val"]
    by_x = defaultdict(dict)
    for e in val:
        by_x[e.x][e.strategy] = e.y
    late_positions = set()
    for x, y in by_x.items():
        assert _first_difference(y["reverse"], y["repeat"]) == 0 and _first_difference(y["reverse"], y["rotate"]) == 0
        late_positions.add(_first_difference(y["repeat"], y["rotate"]))
        assert _first_difference(y["repeat"], y["rotate"]) == len(x.split()) + 1
    assert late_positions == {4, 5, 6}


def test_ambiguous_rows_are_exactly_copy_and_reverse_of_a_palindrome(gen, shipped):
    for split in ("train", "val"):
        for e in shipped["ambiguous", split]:
            digits = e.x.split()
            palindrome = digits == digits[::-1]
            expected = ("copy", "reverse") if palindrome and e.strategy != "double" else (e.strategy,)
            assert gen.candidates("ambiguous", e) == expected


@pytest.mark.parametrize("family", ["late", "ambiguous"])
def test_reachable_nmi_from_the_val_file_alone_equals_the_exact_value_the_readme_states(gen, shipped, family):
    val = shipped[family, "val"]
    exact = gen.family_stats(family, val)
    # what evaluation computes for user JSONL: no task, only repeated (x, y) pairs with their labels
    from_data, _ = reachable_nmi([(e.x, e.y) for e in val], [e.strategy for e in val])
    assert from_data == pytest.approx(exact["nmi_reachable"], abs=1e-12)
    if family == "late":
        assert exact == {"ambiguous_fraction": 0.0, "nmi_reachable": 1.0}
    else:
        assert 0.5 < exact["nmi_reachable"] < 0.95 and 0.05 < exact["ambiguous_fraction"] < 0.3
    readme = (EXAMPLES / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| {family} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[-1]) == pytest.approx(exact["nmi_reachable"], abs=5e-4)
    ambiguous_rows = round(exact["ambiguous_fraction"] * len(val))
    assert cells[-2] == ("0" if ambiguous_rows == 0 else f"{100 * exact['ambiguous_fraction']:.1f}% ({ambiguous_rows} of {len(val)})")
