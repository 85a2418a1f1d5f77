"""bench/latent_meaning.py's counting, on hand-built decodes: whose y each latent wrote, and where q sent each row."""

from __future__ import annotations

from collections import Counter

import pytest

from zcvae.data import Example


@pytest.fixture(scope="module")
def meaning(bench_script):
    return bench_script("latent_meaning")


def _rows(x: str) -> list[Example]:
    d = x.split()
    return [Example(id=f"{x}-copy", x=x, y=x + " .", strategy="copy"),
            Example(id=f"{x}-reverse", x=x, y=" ".join(d[::-1]) + " .", strategy="reverse"),
            Example(id=f"{x}-double", x=x, y=" ".join(c + " " + c for c in d) + " .", strategy="double")]


def test_a_per_x_assignment_shows_as_two_columns_and_a_palindrome_as_a_tie(meaning):
    rows = _rows("1 2 3") + _rows("4 5 6") + _rows("7 8 7")
    decodes = {
        "1 2 3": ["1 2 3 .", "1 1 2 2 3 3 .", "3 2 1 ."],        # z0 copy, z2 reverse
        "4 5 6": ["6 5 4 .", "4 4 5 5 6 6 .", "4  5 6 ."],       # swapped for this x (spacing does not matter)
        "7 8 7": ["7 8 7 .", "7 7 8 8 7 7 .", "9 9 ."],           # palindrome: copy = reverse; z2 writes neither
    }
    writes = meaning.latent_writes(rows, decodes)
    assert writes[0] == Counter({"copy": 1, "reverse": 1, meaning.TIE: 1})
    assert writes[1] == Counter({"double": 3})
    assert writes[2] == Counter({"reverse": 1, "copy": 1, meaning.OTHER: 1})


def test_routing_counts_whether_the_chosen_latent_writes_y(meaning):
    rows = _rows("1 2 3") + _rows("4 5 6")
    decodes = {"1 2 3": ["1 2 3 .", "1 1 2 2 3 3 .", "3 2 1 ."], "4 5 6": ["6 5 4 .", "4 4 5 5 6 6 .", "4 5 6 ."]}
    # q follows the decoder on the first x, and sends copy to z0 on the second, which writes the reverse there
    chosen = [0, 2, 1, 0, 0, 1]
    assert meaning.routing(rows, decodes, chosen) == Counter({
        ("copy", 0, True): 1, ("copy", 0, False): 1, ("reverse", 2, True): 1, ("reverse", 0, True): 1, ("double", 1, True): 2})


def test_unlabelled_rows_are_refused_with_the_line(meaning, tmp_path, capsys):
    data = tmp_path / "u.jsonl"
    data.write_text('{"id": "a", "x": "1 2", "y": "1 2 .", "strategy": "copy"}\n{"id": "b", "x": "3 4", "y": "4 3 ."}\n')
    assert meaning.main([str(tmp_path / "no-model"), str(data)]) == 2
    assert "u.jsonl: example id 'b': missing strategy" in capsys.readouterr().err
