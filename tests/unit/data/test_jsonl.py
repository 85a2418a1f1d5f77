"""JSONL datasets: exact round trip, atomic writes, and errors that name file, line, id and field."""

import json
import os

import pytest

from zcvae.data import Example, make_examples, read_jsonl, write_jsonl


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_round_trip_is_exact(tmp_path):
    examples = make_examples("copy", seed=0, split="val", num_examples=20) + [
        Example(id="unicode-é", x="naïve 中文 \u2028 \u2029 \x85 \x0b \"quoted\" \\ back", y="y with\ttab and\nnewline 🙂"),
        Example(id="no-strategy", x="1 2", y="fwd 1 2 .", strategy=None),
    ]
    path = tmp_path / "sub" / "data.jsonl"
    write_jsonl(path, examples)
    assert read_jsonl(path) == examples
    assert read_jsonl(str(path)) == examples
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(examples)
    assert json.loads(lines[0]).keys() == {"id", "x", "y", "strategy"}
    assert "中文" in lines[-2]  # written as UTF-8, not \u escapes
    assert [p.name for p in path.parent.iterdir()] == ["data.jsonl"]  # no temporary file left


def test_strategy_is_optional_and_blank_lines_are_skipped(tmp_path):
    path = _write_lines(
        tmp_path / "d.jsonl",
        ['\ufeff{"id": "a", "x": "1 2", "y": "fwd 1 2 ."}', "", "   ", '{"id": "b", "x": "3", "y": "rev 3 = 3 .", "strategy": null}'],
    )
    assert read_jsonl(path) == [Example("a", "1 2", "fwd 1 2 ."), Example("b", "3", "rev 3 = 3 .")]
    assert read_jsonl(_write_lines(tmp_path / "empty.jsonl", [""])) == []


@pytest.mark.parametrize(
    "line, line_number, needles",
    [
        ('{"id": "a", "x": "1", "y": "2"', 2, ["invalid JSON"]),
        ('["a", "1", "2"]', 2, ["expected a JSON object"]),
        ('{"x": "1", "y": "2"}', 2, ["missing required field 'id'"]),
        ('{"id": "a", "y": "2"}', 2, ["id 'a'", "missing required field 'x'"]),
        ('{"id": "a", "x": "1"}', 2, ["id 'a'", "missing required field 'y'"]),
        ('{"id": 5, "x": "1", "y": "2"}', 2, ["field 'id' must be a string"]),
        ('{"id": "a", "x": ["1"], "y": "2"}', 2, ["id 'a'", "field 'x' must be a string"]),
        ('{"id": "a", "x": "1", "y": null}', 2, ["id 'a'", "field 'y' must be a string"]),
        ('{"id": "a", "x": "1", "y": ""}', 2, ["id 'a'", "field 'y' is empty"]),
        ('{"id": "a", "x": "1", "y": " \\t "}', 2, ["id 'a'", "field 'y' is empty"]),
        ('{"id": "a", "x": "", "y": "2"}', 2, ["id 'a'", "field 'x' is empty"]),
        ('{"id": "", "x": "1", "y": "2"}', 2, ["field 'id' is empty"]),
        ('{"id": "a", "x": "1", "y": "2", "stratgy": "s"}', 2, ["id 'a'", "unknown field", "stratgy"]),
        ('{"id": "a", "x": "1", "y": "2", "strategy": 3}', 2, ["id 'a'", "field 'strategy'"]),
        ('{"id": "a", "x": "1", "y": "2", "strategy": ""}', 2, ["id 'a'", "field 'strategy'"]),
        ('{"id": "a", "x": "1", "x": "2", "y": "2"}', 2, ["field 'x' appears more than once"]),
        ('{"id": "first", "x": "1", "y": "2"}', 2, ["field 'id'", "duplicate id 'first'", "first on line 1"]),
    ],
)
def test_read_errors_name_file_line_id_and_field(tmp_path, line, line_number, needles):
    path = _write_lines(tmp_path / "bad.jsonl", ['{"id": "first", "x": "1", "y": "2"}', line])
    with pytest.raises(ValueError) as error:
        read_jsonl(path)
    message = str(error.value)
    assert message.startswith(f"{path}:{line_number}:"), message
    for needle in needles:
        assert needle in message, message


def test_read_rejects_invalid_utf8(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"id": "a", "x": "1", "y": "2"}\n{"id": "b", "x": "\xff", "y": "2"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid UTF-8"):
        read_jsonl(path)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (Example(id="e", x="1", y=""), "field 'y' is empty"),
        (Example(id="e", x=" ", y="2"), "field 'x' is empty"),
        (Example(id="first", x="1", y="2"), "duplicate id 'first'"),
        (Example(id="e", x="1", y="2", strategy=7), "field 'strategy'"),
        (Example(id="e", x="\ud800", y="2"), "not encodable as UTF-8"),
        ({"id": "e", "x": "1", "y": "2"}, "expected an Example"),
    ],
)
def test_write_rejects_invalid_examples_and_leaves_the_old_file(tmp_path, bad, needle):
    path = tmp_path / "d.jsonl"
    good = [Example(id="first", x="1", y="2")]
    write_jsonl(path, good)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=needle) as error:
        write_jsonl(path, [*good, bad])
    assert str(error.value).startswith(f"{path}: example 1")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]


def test_write_is_atomic_when_the_final_rename_fails(tmp_path, monkeypatch):
    """A crash between writing and renaming leaves the old file intact and no temporary file."""
    path = tmp_path / "d.jsonl"
    old = make_examples("sort", seed=0, split="train", num_examples=3)
    write_jsonl(path, old)

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_jsonl(path, make_examples("sort", seed=1, split="train", num_examples=50))
    monkeypatch.undo()
    assert read_jsonl(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]
