"""The client's place on the machine (issue 25): the systemd user unit and launchd agent `client install-service`
writes (rendered, then validated by systemd-analyze and plistlib), the cache in the platform cache dir (with the
move of an old cache), and logging that keeps the panel readable (each distinct warning shown once, llama.cpp's
log pieces joined into lines, everything in a rotated file)."""

from __future__ import annotations

import logging
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.exit_codes import NO_RESTART, ExitCode
from swarm_client import logs
from swarm_client.paths import ClientPaths, migrate_cache
from swarm_client.service import (
    ServiceSpec,
    join_argv,
    render_launchd,
    render_systemd,
    systemd_quote,
    unit_path,
)


# ---- the service --------------------------------------------------------------------------------------------------
def _spec(tmp_path: Path) -> ServiceSpec:
    home = tmp_path / "a home with spaces"
    argv = join_argv("http://coordinator.example:8470", tmp_path / "client 100%.toml", home, ["--idle-only"])
    return ServiceSpec(argv, home, home / "logs")


def _unit_words(unit: str) -> list[str]:
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split(" ")


def test_the_systemd_unit_runs_join_with_this_python_and_restarts_only_when_that_can_help(tmp_path: Path) -> None:
    unit = render_systemd(_spec(tmp_path))
    words = _unit_words(unit)
    assert words[:4] == [systemd_quote(sys.executable), "-m", "echo_swarm", "join"]
    assert "--no-panel" in words and "--idle-only" in words
    assert '"--config"' not in unit and f'"{tmp_path}/client 100%%.toml"' in unit  # quoted, % escaped
    assert "Restart=on-failure" in unit
    assert f"RestartPreventExitStatus={' '.join(str(int(c)) for c in NO_RESTART)}" in unit
    assert "WantedBy=default.target" in unit


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit_file = tmp_path / "echo-swarm.service"
    unit_file.write_text(render_systemd(_spec(tmp_path)))
    analyze = shutil.which("systemd-analyze")
    if analyze is None:  # a machine without systemd (macOS): the rendering test above is what runs there
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd): the unit is not validated")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    res = subprocess.run([analyze, "verify", "--user", str(unit_file)], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"XDG_RUNTIME_DIR": str(runtime)})
    complaints = [line for line in res.stderr.splitlines() if unit_file.name in line]
    assert res.returncode == 0 and not complaints, res.stderr
    # and it does complain about a broken one, so the check above is a real one
    unit_file.write_text(render_systemd(_spec(tmp_path)).replace("Restart=on-failure", "Restart=sometimes"))
    res = subprocess.run([analyze, "verify", "--user", str(unit_file)], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"XDG_RUNTIME_DIR": str(runtime)})
    assert "restart specifier" in res.stderr and unit_file.name in res.stderr


def test_the_launchd_agent_is_a_valid_plist(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    agent = plistlib.loads(render_launchd(spec))
    assert agent["ProgramArguments"] == spec.argv  # no shell quoting: launchd takes the argv as is
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True
    assert agent["StandardErrorPath"].startswith(str(spec.log_dir))
    plutil = shutil.which("plutil")
    if plutil is not None:
        path = tmp_path / "agent.plist"
        path.write_bytes(render_launchd(spec))
        assert subprocess.run([plutil, "-lint", str(path)], capture_output=True, timeout=60).returncode == 0


def test_unit_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert unit_path("linux") == tmp_path / "cfg" / "systemd" / "user" / "echo-swarm.service"
    assert unit_path("darwin") == tmp_path / "Library" / "LaunchAgents" / "org.echo-swarm.client.plist"


# ---- where things go ------------------------------------------------------------------------------------------
def test_the_default_home_puts_the_cache_in_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ECHO_SWARM_HOME", raising=False)
    monkeypatch.setenv("ECHO_SWARM_CACHE", str(tmp_path / "cache"))
    paths = ClientPaths.defaults_for(None)
    assert paths.cache == tmp_path / "cache" / "snapshots" and paths.cache.parent != paths.home
    given = ClientPaths.defaults_for(tmp_path / "h")
    assert given == ClientPaths(tmp_path / "h", tmp_path / "h" / "cache", tmp_path / "h" / "logs")
    monkeypatch.setenv("ECHO_SWARM_HOME", str(tmp_path / "env"))
    assert ClientPaths.defaults_for(None).cache == tmp_path / "env" / "cache"


def test_an_old_cache_in_the_home_moves_once(tmp_path: Path) -> None:
    home, cache = tmp_path / "config", tmp_path / "cache" / "snapshots"
    blob = home / "cache" / "blobs" / ("a" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights")
    assert migrate_cache(home, cache) == home / "cache"
    assert (cache / "blobs" / ("a" * 64)).read_bytes() == b"weights" and not (home / "cache").exists()
    (home / "cache").mkdir()  # a later stray folder does not overwrite the moved cache
    assert migrate_cache(home, cache) is None and (cache / "blobs").exists()


# ---- logging -------------------------------------------------------------------------------------------------
def test_each_distinct_warning_reaches_the_terminal_once_and_the_file_always(tmp_path: Path) -> None:
    shown: list[str] = []
    path = logs.setup(tmp_path / "logs", "info", shown.append)
    try:
        log = logging.getLogger("llama.cpp")
        for _ in range(3):
            log.warning("llama_context: n_ctx_seq (%d) > n_ctx_train (%d)", 2048, 64)
        log.warning("another warning")
        log.info("an info line")
        logging.getLogger("swarm_client.runner").error("printed already", extra={logs.SHOWN: True})
    finally:
        logs.teardown()
    assert shown == ["warning: llama.cpp: llama_context: n_ctx_seq (2048) > n_ctx_train (64)",
                     "warning: llama.cpp: another warning"]
    text = path.read_text()
    assert text.count("n_ctx_seq") == 3 and "an info line" in text and "printed already" in text


def test_llama_cpp_log_pieces_become_lines_at_their_level(caplog: pytest.LogCaptureFixture) -> None:
    sink = logs.LlamaLog()
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        sink(2, b"llama_model_loader: loaded meta data", None)
        sink(5, b" with 22 pairs\n", None)  # a continuation, at the level of what it continues
        sink(3, b"llama_context: n_ctx_seq > n_ctx_train\n", None)
        sink(5, b".", None)
        sink(5, b".\n", None)  # progress dots are no message
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "llama.cpp"]
    assert records == [(logging.INFO, "llama_model_loader: loaded meta data with 22 pairs"),
                       (logging.WARNING, "llama_context: n_ctx_seq > n_ctx_train")]


def test_the_log_file_rotates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "LOG_BYTES", 2000)
    path = logs.setup(tmp_path, "debug", lambda _: None)
    try:
        for i in range(200):
            logging.getLogger("x").info("line %d %s", i, "." * 40)
    finally:
        logs.teardown()
    assert path.stat().st_size <= 2000 and (tmp_path / "client.log.1").exists()
    assert len(list(tmp_path.glob("client.log*"))) == logs.LOG_BACKUPS + 1


# ---- the command, end to end ------------------------------------------------------------------------------------
def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], env=env)


def test_install_service_writes_a_unit_that_validates_and_runs_join_and_uninstall_removes_it(tmp_path: Path) -> None:
    """`client install-service --no-start` as a volunteer types it (in a throwaway HOME): the unit it writes is the
    one `--print` shows, passes systemd-analyze verify, and its ExecStart is a working `join` with the volunteer's
    settings (run here against a port where nothing listens: it fails the way join does, exit 5); bad --join-arg
    flags are refused before anything is written; uninstall-service removes the unit."""
    import shlex
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "ECHO_SWARM_"))}
    env |= {"HOME": str(tmp_path / "user"), "XDG_CONFIG_HOME": str(tmp_path / "user" / ".config"),
            "XDG_RUNTIME_DIR": str(tmp_path / "runtime"), "PYTHONUNBUFFERED": "1"}
    (tmp_path / "runtime").mkdir(mode=0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed
    home = tmp_path / "client home"
    unit = tmp_path / "user" / ".config" / "systemd" / "user" / "echo-swarm.service"

    for bad, says in ((["--join-arg=--bogus"], "No such option: --bogus"),
                      (["--join-arg=--threads=0"], "--threads"),
                      (["--join-arg=--window=25:00-07:00"], "window")):
        res = _cli("client", "install-service", url, "--home", str(home), "--no-start", *bad, env=env)
        assert res.returncode == ExitCode.USAGE and says in res.stderr and res.stdout == "", res.stderr
        assert not unit.exists() and not home.exists()
    res = _cli("client", "install-service", "127.0.0.1:8470", "--no-start", env=env)
    assert res.returncode == ExitCode.USAGE and "http://" in res.stderr and not unit.exists()

    args = ["client", "install-service", url, "--home", str(home), "--join-arg=--retries=1", "--join-arg=--name=svc"]
    printed = _cli(*args, "--print", env=env)
    assert printed.returncode == 0 and not unit.exists(), printed.stderr
    res = _cli(*args, "--no-start", env=env)
    assert res.returncode == 0 and res.stdout.strip() == f"wrote {unit}", res.stderr
    assert unit.read_text() == printed.stdout

    analyze = shutil.which("systemd-analyze")
    if analyze is not None:
        check = subprocess.run([analyze, "verify", "--user", str(unit)], capture_output=True, text=True, timeout=120,
                               env=env)
        assert check.returncode == 0 and unit.name not in check.stderr, check.stderr

    exec_start = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart=").replace("%%", "%"))
    assert argv[:4] == [sys.executable, "-m", "echo_swarm", "join"] and argv[argv.index("--home") + 1] == str(home)
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == ExitCode.UNREACHABLE, ran.stdout + ran.stderr
    assert ran.stderr.splitlines()[-1].startswith(f"error: cannot reach the coordinator at {url}"), ran.stderr
    assert int(ExitCode.UNREACHABLE) not in NO_RESTART  # so systemd restarts it a minute later

    gone = _cli("client", "uninstall-service", env=env)
    assert gone.returncode == 0 and f"removed {unit}" in gone.stdout and not unit.exists(), gone.stdout + gone.stderr


def _service_env(tmp_path: Path) -> dict[str, str]:
    """A throwaway user: its own HOME and config dir, and a runtime dir without a user bus (as under su, sudo or a
    container), so `systemctl --user` cannot reach a service manager."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "ECHO_SWARM_", "DBUS_"))}
    env |= {"HOME": str(tmp_path / "user"), "XDG_CONFIG_HOME": str(tmp_path / "user" / ".config"),
            "XDG_RUNTIME_DIR": str(tmp_path / "runtime")}
    (tmp_path / "runtime").mkdir(mode=0o700, exist_ok=True)
    return env


ENABLE_BY_HAND = ("in a login session (not su or sudo), run: systemctl --user daemon-reload && systemctl --user "
                  "enable --now echo-swarm.service")


def test_install_service_fails_when_systemd_does_not_enable_the_unit(tmp_path: Path) -> None:
    """Before, `install-service` exited 0 although nothing would ever run the client. The unit is written (so it
    can be enabled by hand), the reason is one line on stderr with the command to run, and the exit code is 1."""
    if shutil.which("systemctl") is None:
        pytest.skip("systemctl is not installed (Debian: apt-get install systemd): its refusal cannot be seen")
    env = _service_env(tmp_path)
    unit = tmp_path / "user" / ".config" / "systemd" / "user" / "echo-swarm.service"
    res = _cli("client", "install-service", "http://127.0.0.1:8470", "--home", str(tmp_path / "home"), env=env)
    assert res.returncode == ExitCode.FAILED and res.stdout == f"wrote {unit}\n", res.stdout + res.stderr
    assert res.stderr.startswith("error: systemd did not enable echo-swarm.service (") and res.stderr.count("\n") == 1
    assert res.stderr.endswith(f"); {ENABLE_BY_HAND}\n"), res.stderr
    assert unit.is_file()


def test_install_service_fails_without_systemd(tmp_path: Path) -> None:
    env = _service_env(tmp_path) | {"PATH": str(tmp_path / "empty")}  # no systemctl on PATH
    unit = tmp_path / "user" / ".config" / "systemd" / "user" / "echo-swarm.service"
    res = _cli("client", "install-service", "http://127.0.0.1:8470", "--home", str(tmp_path / "home"), env=env)
    assert (res.returncode, res.stdout, res.stderr) == (
        ExitCode.FAILED, f"wrote {unit}\n", "error: systemctl is not available (this machine does not run systemd): "
        "start `echo-swarm join` another way, or install with --no-start to only write the unit\n")
    assert _cli("client", "install-service", "http://127.0.0.1:8470", "--home", str(tmp_path / "home"),
                "--no-start", env=env).returncode == 0  # only writing the unit was asked: done
