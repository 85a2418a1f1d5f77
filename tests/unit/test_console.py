"""zcvae's console: per-subsystem loggers under ``zcvae``, one handler that prints the bare message on rank 0
only, and ``--log-level`` (a level, per-logger levels) taken anywhere on any command's line."""

import logging
import os
import subprocess
import sys

import pytest

from zcvae import console


@pytest.fixture
def levels():
    """Restore every zcvae logger's level after the test."""
    names = ["zcvae", *[n for n in logging.root.manager.loggerDict if n.startswith("zcvae.")]]
    saved = {n: logging.getLogger(n).level for n in names}
    handler = console.install()
    target, handler.target = handler.target, "stdout"
    yield
    handler.target = target
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)
    for name in logging.root.manager.loggerDict:
        if name.startswith("zcvae.") and name not in saved:
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_parse_levels_reads_a_level_and_per_logger_levels_and_names_a_bad_part():
    assert console.parse_levels("warning,zcvae.reference=debug") == {"zcvae": logging.WARNING, "zcvae.reference": logging.DEBUG}
    assert console.parse_levels("zcvae.engines=ERROR") == {"zcvae.engines": logging.ERROR}
    with pytest.raises(ValueError, match="'loud': the level must be one of"):
        console.parse_levels("loud")
    with pytest.raises(ValueError, match="'torch=debug': a logger's name starts with 'zcvae.'"):
        console.parse_levels("torch=debug")


def test_pop_log_level_takes_the_flag_anywhere_and_leaves_the_rest():
    assert console.pop_log_level(["train", "--task", "copy", "--log-level", "debug", "--seed", "1"]) == (
        ["train", "--task", "copy", "--seed", "1"], "debug")
    assert console.pop_log_level(["--log-level=warning", "sweep", "f.yaml"]) == (["sweep", "f.yaml"], "warning")
    assert console.pop_log_level(["train"]) == (["train"], None)
    with pytest.raises(ValueError, match="--log-level needs a value"):
        console.pop_log_level(["train", "--log-level"])


def test_a_subsystem_is_silenced_or_raised_alone(levels, capsys):
    reference, engines = logging.getLogger("zcvae.reference.provider"), logging.getLogger("zcvae.engines.deepspeed")
    console.set_levels("info,zcvae.reference=warning")
    reference.info("[reference] quiet")
    engines.info("[deepspeed] shown")
    reference.warning("[reference] a warning still shows")
    console.set_levels("warning,zcvae.engines=debug")
    engines.debug("[deepspeed] debug shown")
    logging.getLogger("zcvae.train.trainer").info("[run] hidden")
    assert capsys.readouterr().out.splitlines() == ["[deepspeed] shown", "[reference] a warning still shows", "[deepspeed] debug shown"]


def test_only_rank_0_prints_unless_a_record_asks_for_every_rank(levels, capsys, monkeypatch):
    log = logging.getLogger("zcvae.loop.setup")
    monkeypatch.setenv("RANK", "1")
    log.info("[setup] from rank 1")
    log.warning("[guard] every rank", extra={"all_ranks": True})
    monkeypatch.setenv("RANK", "0")
    log.info("[setup] from rank 0")
    assert capsys.readouterr().out.splitlines() == ["[guard] every rank", "[setup] from rank 0"]


def test_use_stderr_keeps_stdout_for_a_commands_result(levels, capsys):
    console.use_stderr()
    logging.getLogger("zcvae.backbone.convert").info("[gguf] converting")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "[gguf] converting\n"


def test_the_cli_takes_log_level_before_or_after_the_command_and_rejects_a_bad_one(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    bad = subprocess.run([sys.executable, "-m", "zcvae", "evaluate", str(tmp_path), "--log-level", "loud"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "zcvae: error: --log-level: 'loud': the level must be one of debug, info, warning, error, critical")
    # a real command's line: the run directory is missing, so evaluate exits 2 with its own one-line error
    for argv in (["--log-level", "error", "evaluate", str(tmp_path / "none")], ["evaluate", str(tmp_path / "none"), "--log-level=error"]):
        done = subprocess.run([sys.executable, "-m", "zcvae", *argv], capture_output=True, text=True, env=env)
        assert done.returncode == 2 and done.stderr.startswith("zcvae evaluate: error:"), done.stderr


def test_a_bad_environment_level_warns_and_keeps_the_default_instead_of_failing_the_import(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), console.ENV: "loud"}
    done = subprocess.run([sys.executable, "-c", "import zcvae, logging; print(logging.getLogger('zcvae').level)"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ZCVAE_LOG_LEVEL: 'loud': the level must be one of debug, info, warning, error, critical; "
                                        "using the default level info", str(logging.INFO)]
