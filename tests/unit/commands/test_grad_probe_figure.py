"""The posterior-gradient figure over two runs' metrics.jsonl (synthetic records)."""

from __future__ import annotations

import json
import math

import pytest

from zcvae.commands.grad_probe_figure import main, read_probe_series


def _write_run(run_dir, rows, *, extra=()):
    """rows: (step, beta, recon norm, kl norm) of the posterior head; plus train records the reader must skip."""
    run_dir.mkdir(parents=True)
    lines = [{"step": 1, "split": "train", "loss": 1.0}]
    for step, beta, recon, kl in rows:
        record = {"step": step, "split": "grad_probe", "kl_weight": beta, "posterior_head/reconstruction_grad_norm": recon,
                  "posterior_head/kl_grad_norm": kl, "posterior_head/scaled_kl_grad_norm": beta * kl,
                  "lora/reconstruction_grad_norm": 10 * recon, "lora/kl_grad_norm": 10 * kl,
                  "lora/scaled_kl_grad_norm": 10 * beta * kl}
        if beta * kl > 0:
            record["posterior_head/reconstruction_to_kl_ratio"] = recon / (beta * kl)
            record["lora/reconstruction_to_kl_ratio"] = recon / (beta * kl)
        lines.append(record)
    lines += list(extra)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_two_runs_give_a_png_and_the_series_read_back(tmp_path):
    # a collapsing run (ratio falls) and a healthy one (ratio stays high); beta is 0 for the first two steps
    _write_run(tmp_path / "raw", [(2, 0.0, 0.1, 0.0), (4, 0.0, 0.05, 0.2), (6, 0.5, 0.02, 0.2), (8, 1.0, 0.001, 0.1)],
               extra=[{"step": 8, "split": "grad_probe", "kl_weight": 1.0, "posterior_head/reconstruction_grad_norm": 0.004,
                       "posterior_head/kl_grad_norm": 0.1, "posterior_head/scaled_kl_grad_norm": 0.1,
                       "posterior_head/reconstruction_to_kl_ratio": 0.04}])  # a resumed run logged step 8 again
    _write_run(tmp_path / "dist", [(2, 0.0, 0.3, 0.0), (4, 0.0, 0.3, 0.1), (6, 0.5, 0.4, 0.1), (8, 1.0, 0.5, 0.1)])
    raw = read_probe_series(tmp_path / "raw")
    assert raw["step"] == [2, 4, 6, 8] and raw["kl_weight"] == [0, 0, 0.5, 1]
    assert math.isnan(raw["ratio"][0]) and math.isnan(raw["ratio"][1])  # beta = 0: undefined, a gap
    assert raw["ratio"][2:] == pytest.approx([0.2, 0.04])  # the last record of step 8 wins
    assert raw["reconstruction"] == pytest.approx([0.1, 0.05, 0.02, 0.004])
    assert read_probe_series(tmp_path / "dist", group="lora")["reconstruction"] == pytest.approx([3, 3, 4, 5])

    out = tmp_path / "fig" / "grad_probe.png"
    assert main([str(tmp_path / "raw"), str(tmp_path / "dist"), "--labels", "raw mean", "dist", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "raw"), str(tmp_path / "dist"), "--group", "lora", "--out", str(tmp_path / "l.png")]) == 0
    assert (tmp_path / "l.png").stat().st_size > 0


def test_a_run_without_probe_records_is_named(tmp_path, capsys):
    _write_run(tmp_path / "plain", [])
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "plain"), "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "plain" in err and "--grad-probe-every" in err and not (tmp_path / "x.png").exists()
