"""The extension build lock (zcvae.engines.extensions): a lock left by a killed build never hangs a run.

The locks here are real files judged by the real /proc scan; only the clock is moved, so that a lock's
age does not have to be waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from zcvae.engines.extensions import StaleBuildLock, check_build_locks, extensions_dir, local_builders


def _plant(root, name="deepspeed_shm_comm", age_s=600.0):
    build = root / name
    build.mkdir(parents=True)
    (build / "build.ninja").write_text("# a build that was killed\n")
    lock = build / "lock"
    lock.touch()
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock


def test_the_default_directory_is_per_environment_and_set_for_torch(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    root, chosen = extensions_dir(env)
    assert not chosen
    assert root.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}_") and root.name.count("-") >= 2
    assert check_build_locks(environ=env) == root and env["TORCH_EXTENSIONS_DIR"] == str(root)
    # the user's choice wins, and is reported as theirs
    assert extensions_dir({"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}) == (tmp_path / "mine", True)


def test_a_stale_lock_in_zcvaes_directory_is_removed_with_one_line(tmp_path, logged):
    lines = logged
    own, _ = extensions_dir({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    lock = _plant(own)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    start = time.monotonic()
    check_build_locks(environ=env)
    assert time.monotonic() - start < 5
    assert not lock.exists() and (lock.parent / "build.ninja").exists()  # only the lock goes
    assert len(lines) == 1 and str(lock) in lines[0] and "stale" in lines[0]


def test_a_stale_lock_in_the_users_directory_stops_naming_the_file(tmp_path):
    root = tmp_path / "ext"
    lock = _plant(root)
    with pytest.raises(StaleBuildLock, match=rf"rm {lock}"):
        check_build_locks(environ={"TORCH_EXTENSIONS_DIR": str(root)})
    assert lock.exists()  # another host may share the directory: never removed there


def test_a_young_lock_is_waited_on_until_it_is_old_enough_to_judge(tmp_path):
    own, _ = extensions_dir({"XDG_CACHE_HOME": str(tmp_path)})
    lock = _plant(own, age_s=0.0)
    now = [time.time()]
    waits = []

    def sleep(s):
        waits.append(s)
        now[0] += s

    check_build_locks(environ={"XDG_CACHE_HOME": str(tmp_path)}, clock=lambda: now[0], sleep=sleep, stale_after_s=10)
    assert not lock.exists() and 9 <= sum(waits) <= 12  # bounded: judged once it is stale_after_s old


@pytest.mark.skipif(not os.path.exists("/proc/self/cwd"), reason="needs /proc")
def test_a_lock_with_a_live_builder_is_left_to_torch(tmp_path):
    own, _ = extensions_dir({"XDG_CACHE_HOME": str(tmp_path)})
    lock = _plant(own)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        deadline = time.time() + 10
        while builder.pid not in (local_builders(lock.parent) or []) and time.time() < deadline:
            time.sleep(0.1)
        assert builder.pid in local_builders(lock.parent)
        check_build_locks(environ={"XDG_CACHE_HOME": str(tmp_path)})
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
