"""A client that runs for months (issue 25): when the run finishes it stops leasing and waits for the operator's
next run at the same URL, then joins it; `client finish` ends it after the job in hand; a coordinator that no longer
knows it (a new run) is rejoined; snooze, battery and the data budget hold back new work. The real join loop
(``Runner._serve``) runs against the scripted coordinator of client_fakes.py."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from shared import PROTOCOL_VERSION, crypto
from shared.errors import ProtocolError, Reason
from shared.messages import Info, Job, LeaseResponse, RegisterResponse
from shared.policy import Sampled
from swarm_client import gates, leasing
from swarm_client import runner as runner_mod
from swarm_client.control import read_controls, snooze, update_controls
from swarm_client.identity import Identity
from swarm_client.reporting import FINISHED_STATE
from swarm_client.runner import Runner
from swarm_client.submissions import SETBACK_MAX_S, setback_delay

from .client_fakes import COORDINATOR_KEY, NullBackend, ScriptedCoordinator, make_client, reply, serve


def finished(version: int) -> LeaseResponse:
    return LeaseResponse(job=None, retry_after_s=0.0, current_version=version, finished=True)


class NewRunCoordinator(ScriptedCoordinator):
    """Serves run-1 until ``infos`` is spent, then run-2; records registrations and every state the client
    reported while it waited."""

    def __init__(self, runner: Runner, identity: Identity, script: list[Any], infos: list[str]) -> None:
        super().__init__(runner, identity, script)
        self.infos = list(infos)
        self.registered: list[str] = []
        self.states_at_info: list[str] = []

    def run_id(self) -> str:
        return self.infos[0] if self.infos else "run-2"

    async def info(self) -> Info:
        self.states_at_info.append(self.runner.stats.state)
        run = self.infos.pop(0) if self.infos else "run-2"
        return Info(protocol=PROTOCOL_VERSION, run_id=run, coordinator_public_key=crypto.public_bytes(COORDINATOR_KEY),
                    current_version=0, sync_mode="sequential-pull", task="arithmetic", finished=run == "run-1",
                    server_time=1000.0)

    async def post(self, path: str, message: Any, response_type: type) -> Any:
        if path == "/v1/register":
            run = "run-1" if not self.registered else "run-2"
            self.registered.append(run)
            return RegisterResponse(client_id=self.identity.client_id, new=True, run_id=run)
        return await super().post(path, message, response_type)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leasing, "FINISHED_POLL_S", 0.0)
    for module in (leasing, gates):  # the waits of the leasing loop and of the gates
        monkeypatch.setattr(module, "GATE_POLL_S", 0.01)


def _serve(runner: Runner, identity: Identity, coordinator: ScriptedCoordinator,
           backend: NullBackend | None = None) -> int:
    async def go() -> int:
        try:
            return await runner._serve(coordinator, identity, backend or NullBackend())  # type: ignore[arg-type]
        finally:
            if runner.downloads.prefetch is not None and not runner.downloads.prefetch.done():
                runner.downloads.prefetch.cancel()

    return asyncio.run(go())


def test_a_finished_run_stops_leasing_and_the_next_run_is_joined(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    runner, identity = make_client(tmp_path / "home", monkeypatch)
    cid = identity.client_id
    coordinator = NewRunCoordinator(runner, identity, [finished(3), reply(0, job_version=0, client_id=cid)],
                                    infos=["run-1", "run-1", "run-1"])  # first contact, then two polls: still run-1
    assert _serve(runner, identity, coordinator) == runner_mod.EXIT_OK
    assert coordinator.registered == ["run-1", "run-2"]
    # while the finished run was polled the client said so, and asked for no job (one lease before, then run-2's)
    assert coordinator.states_at_info[1:] == [FINISHED_STATE] * 3
    assert len(coordinator.held) == 3  # finished(3); then in run-2: the job, and the spent script's stop
    assert coordinator.submitted == [0] and runner.stats.run_id == "run-2"


def test_exit_when_finished_exits_instead_of_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, identity = make_client(tmp_path / "home", monkeypatch, exit_when_finished=True)
    coordinator, _ = serve(runner, identity, [finished(3), reply(3)])
    assert len(coordinator.held) == 1  # no lease after the finished reply


class FinishingBackend(NullBackend):
    """Generates, and meanwhile the volunteer runs `echo-swarm client finish`."""

    def __init__(self, home: Path) -> None:
        super().__init__()
        self.home = home

    def generate(self, job: Job, should_stop: Any) -> list[Sampled]:
        update_controls(self.home, finish=True)
        return super().generate(job, should_stop)


def test_finish_submits_the_job_in_hand_then_exits_and_clears_itself(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    runner, identity = make_client(home, monkeypatch)
    cid = identity.client_id
    coordinator = ScriptedCoordinator(runner, identity, [reply(0, job_version=0, client_id=cid),
                                                         reply(0, job_version=0, client_id=cid, job_id="v0-j1")])
    assert _serve(runner, identity, coordinator, FinishingBackend(home)) == runner_mod.EXIT_OK
    assert coordinator.submitted == [0]  # the job in hand was submitted...
    assert len(coordinator.held) == 1  # ...and no other job leased
    assert not read_controls(home).finish  # obeyed: the next start works normally


def test_a_lease_arriving_after_finish_is_handed_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    runner, identity = make_client(home, monkeypatch)
    cid = identity.client_id

    def finish_then_job(r: Runner) -> LeaseResponse:
        update_controls(home, finish=True)  # lands while this lease request is in flight
        return reply(0, job_version=0, client_id=cid)

    coordinator = ScriptedCoordinator(runner, identity, [finish_then_job])
    assert _serve(runner, identity, coordinator) == runner_mod.EXIT_OK
    assert coordinator.released == ["v0-j0"] and coordinator.submitted == []


def test_a_coordinator_that_forgot_the_client_is_joined_again(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    runner, identity = make_client(tmp_path / "home", monkeypatch)

    def unknown(r: Runner) -> LeaseResponse:
        raise ProtocolError(Reason.UNKNOWN_CLIENT, "this client is not registered; register first")

    coordinator = NewRunCoordinator(runner, identity, [unknown, reply(0)], infos=["run-1"])
    assert _serve(runner, identity, coordinator) == runner_mod.EXIT_OK
    assert coordinator.registered == ["run-1", "run-2"]


def test_snooze_battery_and_data_budget_hold_back_new_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    runner, _ = make_client(home, monkeypatch, max_gb_per_month=1.0)
    until = snooze(home, 1800)
    assert asyncio.run(runner.gates.gate()) == f"snoozed until {datetime.fromtimestamp(until):%H:%M}"
    update_controls(home, snooze_until=None)
    assert asyncio.run(runner.gates.gate()) is None
    runner.gates._battery = (time.monotonic(), True)  # read a moment ago: on battery
    assert asyncio.run(runner.gates.gate()) == "on battery"
    runner.gates._battery = (time.monotonic(), False)
    runner.meter.add(10**9)
    assert asyncio.run(runner.gates.gate()).startswith("monthly data cap reached (1.00 of 1 GB)")


def test_a_bandwidth_cap_set_at_run_time_applies_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    runner, _ = make_client(home, monkeypatch, max_mbps=5.0)
    assert runner.throttle.rate == 5e6
    update_controls(home, max_mbps=0.5)
    runner.gates.apply()
    assert runner.throttle.rate == 5e5
    update_controls(home, max_mbps=None)  # back to the configured cap
    runner.gates.apply()
    assert runner.throttle.rate == 5e6


class RefusingCoordinator(ScriptedCoordinator):
    """Refuses every result with ``reason`` (a refusal about the coordinator's state, or about the result)."""

    def __init__(self, runner: Runner, identity: Identity, script: list[Any], reason: Reason) -> None:
        super().__init__(runner, identity, script)
        self.reason = reason

    async def post(self, path: str, message: Any, response_type: type) -> Any:
        if path == "/v1/results":
            self.submitted.append(message.version)
            raise ProtocolError(self.reason, "refused by the script")
        return await super().post(path, message, response_type)


class RecordingStop:
    """The runner's stop event, whose waits are recorded and return at once (no test waits on the clock)."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._set = False

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return self._set

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def test_setbacks_in_a_row_back_off_and_an_accepted_result_ends_them() -> None:
    assert [setback_delay(n) for n in range(7)] == [0.0, 0.0, 0.0, 5.0, 10.0, 20.0, 40.0]
    assert setback_delay(40) == SETBACK_MAX_S


@pytest.mark.parametrize(("reason", "backs_off"), [(Reason.VERSION_RETIRED, True), (Reason.CHOICE_MISMATCH, False)])
def test_a_client_refused_for_the_coordinators_reasons_backs_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 reason: Reason, backs_off: bool) -> None:
    """A client whose results keep meeting version_retired (the coordinator pruned the version under it) waits,
    longer each time, instead of computing job after job into the same refusal (one client looped 2,900 times);
    a refusal about its own result is no such streak."""
    stop = RecordingStop()
    runner, identity = make_client(tmp_path / "home", monkeypatch, stop=stop)  # type: ignore[arg-type]
    cid = identity.client_id
    jobs = [reply(0, job_version=0, client_id=cid, job_id=f"v0-j{k}") for k in range(6)]
    coordinator = RefusingCoordinator(runner, identity, jobs, reason)
    assert _serve(runner, identity, coordinator) == runner_mod.EXIT_OK
    assert len(coordinator.submitted) == 6
    pauses = [w for w in stop.waits if w >= 5.0]
    if backs_off:  # from the third setback in a row (the last result's verdict may land after the last lease)
        assert pauses[:2] == [5.0, 10.0], stop.waits
    else:
        assert pauses == [], stop.waits
