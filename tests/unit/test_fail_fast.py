"""Fail fast, in one line, writing nothing (issue 25): the coordinator's pre-flight checks (port, model folder, run
directory, disk), and the client's first contact telling "nothing listening" from "not an echo-swarm coordinator"
(against real sockets and a real aiohttp server on loopback), then, once joined, waiting out an outage with one
line when it starts and one when it ends."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from aiohttp import web

from coordinator.config import load_config
from coordinator.launch.preflight import (
    PreflightError,
    check,
    check_disk,
    check_model,
    check_port,
    check_run_dir,
)
from shared import wire
from shared.exit_codes import ExitCode
from shared.messages import ErrorBody
from swarm_client.api import (
    ClientStopping,
    CoordinatorClient,
    CoordinatorUnreachable,
    NotACoordinator,
    RetryPolicy,
)
from swarm_client.config import ClientConfigError, build


def _code(fn: object, *args: object) -> PreflightError:
    with pytest.raises(PreflightError) as err:
        fn(*args)  # type: ignore[operator]
    assert "\n" not in err.value.message
    return err.value


# ---- the coordinator's pre-flight -------------------------------------------------------------------------
def test_a_port_in_use_is_found_before_anything_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _code(check_port, "127.0.0.1", port)
    assert err.code == ExitCode.PORT_IN_USE and f"port {port}" in err.message and "--port" in err.message
    check_port("127.0.0.1", port)  # free again
    check_port("127.0.0.1", 0)
    assert _code(check_port, "192.0.2.123", 8470).code == ExitCode.USAGE  # not an address of this machine


def test_a_model_folder_is_checked_for_what_loading_needs(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert check_model("tiny") is None
    assert check_model(str(tiny_model_dir)) == tiny_model_dir
    assert "does not exist" in _code(check_model, str(tmp_path / "nope")).message
    folder = tmp_path / "model"
    folder.mkdir()
    assert "no config.json" in _code(check_model, str(folder)).message
    (folder / "config.json").write_text("{")
    assert "does not read as JSON" in _code(check_model, str(folder)).message
    (folder / "config.json").write_text("{}")
    assert "no *.safetensors" in _code(check_model, str(folder)).message
    (folder / "model.safetensors").write_bytes(b"\x00" * 3)
    err = _code(check_model, str(folder))
    assert err.code == ExitCode.MODEL_INVALID and "no tokenizer" in err.message
    (folder / "tokenizer.json").write_text("{}")
    assert "does not read" in _code(check_model, str(folder)).message  # a truncated weights file


def test_the_run_dir_must_be_creatable(tmp_path: Path) -> None:
    check_run_dir(tmp_path / "new" / "run")  # does not exist yet: its parent is writable
    (tmp_path / "file").write_text("")
    err = _code(check_run_dir, tmp_path / "file")
    assert err.code == ExitCode.RUN_DIR_UNWRITABLE and "not a folder" in err.message
    assert _code(check_run_dir, tmp_path / "file" / "run").code == ExitCode.RUN_DIR_UNWRITABLE
    assert not (tmp_path / "new").exists()  # checked, not created
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # the check's own folder is gone too


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_run_dir_in_proc_is_one_line_and_its_exit_code(tmp_path: Path) -> None:
    """/proc passes a permission check for root, then mkdir failed deep in the supervisor with a 40-line traceback.
    The preflight makes (and removes) a folder there first: one line on stderr, exit 12, nothing started."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "echo_swarm", "coordinator", "--run-dir", "/proc/nope", "--port", "0"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (res.returncode, res.stdout) == (ExitCode.RUN_DIR_UNWRITABLE, ""), res.stderr
    assert res.stderr in ("error: run_dir /proc/nope cannot be created in /proc (No such file or directory): pass a "
                          "--run-dir in a folder you can write\n",  # root
                          "error: run_dir /proc/nope cannot be created: /proc is not writable by this user: pass a "
                          "--run-dir in a folder you can write, or fix its permissions\n"), res.stderr
    assert list(tmp_path.iterdir()) == []


def test_not_enough_disk_for_one_version(tmp_path: Path) -> None:
    check_disk(tmp_path, 1)
    err = _code(check_disk, tmp_path, 2**62)
    assert err.code == ExitCode.NO_DISK_SPACE and "snapshots.gguf" in err.message


def test_check_runs_the_checks_each_role_needs(tmp_path: Path) -> None:
    config = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "missing"),
                                "server.port": 0})
    assert _code(check, config, "all").code == ExitCode.MODEL_INVALID
    check(config, "api")  # the API does not load the model
    assert not (tmp_path / "run").exists()


# ---- the client's first contact ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _site(handler: object) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize("status", [404, 200])
def test_a_web_server_is_not_a_coordinator(status: int) -> None:
    async def page(request: web.Request) -> web.Response:
        return web.Response(status=status, text="<!DOCTYPE HTML><html><body>It works!</body></html>",
                            content_type="text/html")

    async def main() -> None:
        runner, url = await _site(page)
        api = CoordinatorClient(url, None, retry=RetryPolicy(attempts=3, base_s=0.01))
        try:
            with pytest.raises(NotACoordinator, match="not as an echo-swarm coordinator") as err:
                await api.info()
            assert (f"HTTP {status}" in str(err.value)) == (status == 404)
        finally:
            await api.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_coordinators_refusal_is_still_a_refusal() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=403, body=wire.encode(ErrorBody(error="banned", message="no")),
                            content_type="application/msgpack")

    async def main() -> None:
        runner, url = await _site(refuse)
        api = CoordinatorClient(url, None, retry=RetryPolicy(attempts=1))
        try:
            with pytest.raises(Exception) as err:
                await api.info()
            assert not isinstance(err.value, NotACoordinator) and getattr(err.value, "code", "") == "banned"
        finally:
            await api.close()
            await runner.cleanup()

    asyncio.run(main())


def test_nothing_listening_fails_within_seconds_with_one_line_per_retry() -> None:
    lines: list[str] = []

    async def main() -> None:
        api = CoordinatorClient(f"http://127.0.0.1:{_free_port()}", None, on_retry=lines.append,
                                retry=RetryPolicy(attempts=3, base_s=0.05))
        try:
            t0 = time.monotonic()
            with pytest.raises(CoordinatorUnreachable) as err:
                await api.info()
            assert time.monotonic() - t0 < 10
            assert "connection refused" in str(err.value) and "3 attempts" in str(err.value)
        finally:
            await api.close()

    asyncio.run(main())
    assert len(lines) == 2 and all("\n" not in x and "connection refused" in x and "retry" in x for x in lines)


def test_once_joined_an_outage_is_one_line_when_lost_and_one_when_back() -> None:
    events: list[str | None] = []
    port = _free_port()
    answers = iter([503, 503, 200])  # the restarted coordinator's first answers, then its reply

    async def info(request: web.Request) -> web.Response:
        return web.Response(status=next(answers), body=b"reply")

    async def main() -> bytes:
        api = CoordinatorClient(f"http://127.0.0.1:{port}", None, on_outage=events.append,
                                retry=RetryPolicy(attempts=2, base_s=0.01, max_s=0.05))
        api.patient = True  # joined: far more than `attempts` failures are waited out
        app = web.Application()
        app.router.add_get("/{tail:.*}", info)
        runner = web.AppRunner(app)
        await runner.setup()
        attempts = 0

        def count(line: str) -> None:
            nonlocal attempts
            attempts += 1

        api.on_retry = count  # never called once joined: no line per attempt

        async def come_back() -> None:  # nothing listens until the client has been refused for a while
            while api.down_since is None or time.monotonic() - api.down_since < 0.5:
                await asyncio.sleep(0.01)
            await web.TCPSite(runner, "127.0.0.1", port).start()

        back = asyncio.create_task(come_back())
        try:
            return await api.get_raw("/v1/info")
        finally:
            back.cancel()
            assert attempts == 0
            await api.close()
            await runner.cleanup()

    assert asyncio.run(main()) == b"reply"
    assert len(events) == 2 and events[0] is not None and "connection refused" in events[0] and events[1] is None


def test_give_up_after_bounds_an_outage() -> None:
    async def main() -> None:
        api = CoordinatorClient(f"http://127.0.0.1:{_free_port()}", None,
                                retry=RetryPolicy(base_s=0.01, max_s=0.05, give_up_after_s=0.3))
        api.patient = True
        try:
            with pytest.raises(CoordinatorUnreachable, match="--give-up-after 0.3s"):
                await api.get_raw("/v1/info")
        finally:
            await api.close()

    asyncio.run(main())


def test_a_url_without_a_scheme_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ECHO_SWARM_CONFIG", str(tmp_path / "no-such-client.toml"))
    for bad, hint in (("coordinator.example:8470", "http://coordinator.example:8470"),
                      ("ftp://x:1", "http://x:1")):
        with pytest.raises(ClientConfigError, match="needs http:// or https://") as err:
            build({"url": bad, "home": tmp_path})
        assert hint in str(err.value)
    assert build({"url": "https://c.example/", "home": tmp_path}).url == "https://c.example"


def test_ctrl_c_during_an_outage_stops_at_once() -> None:
    async def main() -> float:
        api = CoordinatorClient(f"http://127.0.0.1:{_free_port()}", None, retry=RetryPolicy(base_s=60, max_s=60))
        api.patient = True  # joined: it would retry for ever, a minute apart
        stop_at = time.monotonic() + 0.5
        api.stopping = lambda: time.monotonic() > stop_at
        try:
            t0 = time.monotonic()
            with pytest.raises(ClientStopping):
                await api.get_raw("/v1/info")
            return time.monotonic() - t0
        finally:
            await api.close()

    assert asyncio.run(main()) < 5
