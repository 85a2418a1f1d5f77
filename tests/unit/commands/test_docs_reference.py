"""docs/reference/ is generated from the parsers and the config fields' help: it must be current, and it
must hold every flag that `zcvae train --help` shows."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from zcvae.commands import cli
from zcvae.commands.docs_reference import main, pages
from zcvae.config import SECTIONS

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference"


def test_reference_pages_are_current():
    for name, text in pages().items():
        path = REFERENCE / name
        assert path.is_file() and path.read_text() == text, (
            f"{path} is out of date: run `python -m zcvae.commands.docs_reference` and commit the result")


def test_every_train_flag_and_config_field_is_in_the_reference():
    cli_page, config_page = (REFERENCE / "cli.md").read_text(), (REFERENCE / "config.md").read_text()
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["train"]._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in cli_page, flag
    for section, cls in SECTIONS.items():
        assert f"\n## {section}\n" in config_page
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in config_page, f.name


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "cli.md").write_text("edited by hand\n")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert "cli.md" in capsys.readouterr().err
