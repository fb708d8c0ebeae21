"""The settings of one `echo-swarm join` process, in one place: the config file's keys, the command's flags and
their --help texts, and the options table in docs/client.md are all this model's fields and descriptions
(echo_swarm/cli.py takes each flag's help from here; tests/unit/test_cli_conventions.py keeps the docs in step).

Light on purpose (pydantic only; validators import what they need), so that `echo-swarm --help` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.safe_text import check_printable
from swarm_client.schedule import parse_window

#: `join` flags whose name is not their field's (the config file accepts either spelling).
FLAG_FIELDS = {"window": "windows", "wait_for_coordinator": "wait_for_coordinator_s", "serve": "p2p_serve",
               "max_upload_gb": "p2p_max_upload_gb", "give_up_after": "give_up_after_s"}

def http_url(v: str) -> str:
    """A coordinator URL, normalised (no trailing slash), or a ValueError that says how to write it."""
    from urllib.parse import urlsplit

    v = v.strip()
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        guess = v.split("://", 1)[-1]
        raise ValueError(f"coordinator URL {v!r} needs http:// or https:// and a host: write e.g. "
                         f"http://{guess or 'HOST:8470'}")
    if parts.query or parts.fragment:
        raise ValueError(f"coordinator URL {v!r} has a query or fragment; give the scheme, host and port, e.g. "
                         f"{parts.scheme}://{parts.netloc}")
    return v.rstrip("/")


def attached_run(entry: str) -> tuple[str, float]:
    """``URL`` or ``URL=SHARE`` (a share above 0, default 1) → (URL, share); a ValueError that says the form."""
    url, sep, share = entry.rpartition("=")
    if not sep:
        return http_url(entry), 1.0
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1e6:
        raise ValueError(f"attach {entry!r}: the share after '=' must be a number above 0, e.g. {url}=2")
    return http_url(url), value


class JoinConfig(BaseModel):
    """Settings of one `echo-swarm join` process."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Coordinator URL, e.g. http://127.0.0.1:8470 (or `url` in the config file).")
    home: Path = Field(description="Folder for this client's identity key, pinned coordinator keys and pause/status "
                       "files (and, when given, its snapshot cache and log). Default: your user config dir (or "
                       "$ECHO_SWARM_HOME).")
    backend: str = Field("auto", description="Generation backend: 'llama' (llama.cpp, fastest per sequence; needs "
                         "the llama extra, built for Metal/CUDA/CPU as the README explains), 'torch' (needs the torch "
                         "extra), or 'auto' (llama where installed, else torch).")
    device: str = Field("auto", description="'auto' picks CUDA, then Apple MPS, then CPU; or cpu, cuda, mps.")
    precision: Literal["auto", "f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"] = Field(
        "auto", description="llama.cpp backend: the GGUF precision to download and run, one the run offers "
        "(`echo-swarm join` says which). 'auto' takes the best one that fits this machine's memory ceiling "
        "(f16 before q8_0 before q4_K_M ...), checked from the signed manifest before anything is downloaded. "
        "Every precision is verified equally tightly (on the very file you ran); a smaller one needs less memory "
        "and download.")
    torch_dtype: Literal["float32", "bfloat16"] = Field("float32", description="What the torch backend computes in: "
                                                        "bfloat16 needs half the memory (a 7 B model fits a 16 GB "
                                                        "GPU only so); the coordinator checks such results against "
                                                        "its own bf16 replay of them.")
    threads: int | None = Field(None, ge=1, description="CPU threads for generation; unset: the backend's choice.")
    name: str = Field("", max_length=64, description="Display name on the leaderboard.")
    team: str = Field("", max_length=64, description="Team to count for on the status page's team leaderboard: every "
                      "volunteer naming the same team is added up there.")
    max_jobs: int | None = Field(None, ge=1, description="Exit after this many accepted results (this session).")
    exit_when_finished: bool = Field(False, description="Exit once the coordinator's run has finished, instead of "
                                     "waiting for the operator's next run at the same URL.")
    max_cpu_percent: float = Field(100.0, gt=0, le=100, description="Use at most this share of time for generation "
                                   "(percent, above 0): the client idles between decoding steps.")
    retries: int = Field(5, ge=1, le=100, description="Attempts of the first contact (before joining) when the "
                         "coordinator does not answer, with backoff from 0.5 s; a wrong URL fails within seconds. "
                         "Once joined, outages are waited out (see give_up_after_s).")
    give_up_after_s: float | None = Field(None, gt=0, le=1e9, description="Once joined, how long (seconds) the "
                                          "coordinator may stay unreachable before the client gives up and exits; "
                                          "None: never (it retries with backoff up to retry_max_s apart, one line "
                                          "when the coordinator is lost and one when it is back).")
    retry_max_s: float = Field(60.0, ge=1, le=3600, description="Longest wait between two attempts to reach a lost "
                               "coordinator (exponential backoff from 0.5 s, capped here).")
    wait_for_coordinator_s: float = Field(0.0, ge=0, le=86_400, description="Seconds to keep looking (every half "
                                          "second) for a coordinator that is not up yet (one being started) before "
                                          "the first contact's retries begin; 0 = only those retries.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="What goes to the log file (client.log, rotated, in the client's log folder); the "
        "terminal shows warnings and errors, each distinct one once.")
    cache_dir: Path | None = Field(None, description="Snapshot cache folder. Default: the platform's cache dir "
                                   "(~/.cache/echo-swarm/snapshots) for the default home, else HOME/cache.")
    log_dir: Path | None = Field(None, description="Log folder. Default: the platform's log dir "
                                 "(~/.local/state/echo-swarm/log) for the default home, else HOME/logs.")
    coordinator_key: str | None = Field(None, description="The coordinator's public key (hex) as published by its "
                                        "operator; unset: the key seen on first contact is pinned (trust on first "
                                        "use).")
    invite: str = Field("", max_length=128, description="Invite token for a private swarm (registration.mode = "
                        "'invite' on the coordinator); empty for open swarms.")
    # volunteer experience: resource caps, when to work, cache, benchmark (see swarm_client/schedule.py)
    gpu_layers: int | None = Field(None, ge=0, le=10_000, description="Model layers to put on the GPU; 0 turns the "
                                   "GPU off (CPU only); unset: all layers when a GPU is found. The torch backend puts "
                                   "all or nothing on the GPU.")
    max_memory_gb: float | None = Field(None, gt=0, le=1e6, description="Memory ceiling in GiB. The model's memory "
                                        "need — the backend's measured peak: weights, loading, the KV cache and "
                                        "prefill of a job's batch (swarm_client/footprint.py) — is checked against it "
                                        "from the signed manifest before anything is downloaded, and again before "
                                        "loading; a model that does not fit is refused. Unset: 80 % of RAM.")
    min_free_disk_gb: float = Field(1.0, ge=0, le=1e6, description="Refuse a download that would leave less free "
                                    "disk than this, in GiB.")
    cache_max_gb: float | None = Field(None, gt=0, le=1e6, description="Snapshot cache cap in GiB (least recently "
                                       "used versions are pruned); None = no cap beyond the newest two versions.")
    idle_only: bool = Field(False, description="Start a job only while the machine is otherwise idle: nobody has "
                            "used keyboard or mouse for idle_input_minutes where the platform says, else at least "
                            "idle_min_percent of CPU time idle over a 1 s sample between jobs.")
    idle_min_percent: float = Field(80.0, gt=0, le=100, description="With idle_only, where input is not observed: "
                                    "the CPU idle share, in percent, that counts as idle.")
    windows: list[str] = Field(default_factory=list, max_length=16, description="Daily local-time windows "
                               "HH:MM-HH:MM in which new jobs may start, e.g. 22:00-07:00 (repeat the flag for "
                               "several); empty = any time.")
    benchmark: bool = Field(True, description="Run a few-second self-benchmark at startup and report its tokens/s "
                            "at registration.")
    panel: bool | None = Field(None, description="Live terminal panel, or plain log lines; unset: the panel when "
                               "stdout is a terminal.")
    # volunteer controls (swarm_client/bandwidth.py, swarm_client/presence.py, swarm_client/webcontrol.py)
    max_mbps: float | None = Field(None, gt=0, le=1e5, description="Cap on snapshot download speed, in MB/s "
                                   "(the control page can change it while the client runs); None = no cap.")
    max_gb_per_month: float | None = Field(None, gt=0, le=1e7, description="Data budget per calendar month, in GB "
                                           "(downloads, requests and replies, counted across restarts): once it is "
                                           "used up no new job starts until the month turns. None = no budget.")
    pause_on_battery: bool = Field(True, description="Start no new job while this machine runs on battery "
                                   "(Linux: /sys/class/power_supply; macOS: pmset).")
    idle_input_minutes: float = Field(5.0, gt=0, le=1440, description="With idle_only: minutes without keyboard or "
                                      "mouse input after which the machine counts as idle, where the platform "
                                      "says (macOS; a Linux desktop's idle monitor or xprintidle); elsewhere CPU "
                                      "load decides.")
    control_page: bool = Field(True, description="Serve the local control page on 127.0.0.1 (never another "
                               "address), protected by a token in the client home; `echo-swarm client open` "
                               "opens it.")
    control_port: int = Field(0, ge=0, le=65535, description="Port of the local control page on 127.0.0.1; 0 = the "
                              "port it had last time if free (a bookmark keeps working), else any free port "
                              "(written to the client home for `echo-swarm client open`).")
    # snapshots from other volunteers over libp2p (the p2p extra; swarm_client/peer_fetch.py)
    p2p: bool = Field(False, description="Fetch snapshot files from peers over libp2p when the coordinator runs a "
                      "peer (every piece checked against the signed manifest; HTTP is the fallback).")
    p2p_serve: bool = Field(True, description="With p2p: serve verified files to other volunteers (--no-serve).")
    p2p_max_upload_gb: float | None = Field(None, gt=0, le=1e6, description="With p2p: stop serving after this many "
                                            "GB uploaded in this session; None = no cap.")
    p2p_uploads: int = Field(2, ge=1, le=64, description="With p2p: uploads served at once (U).")
    p2p_uploads_per_blob: int = Field(3, ge=1, le=1000, description="With p2p: uploads of one file in this session (T).")
    p2p_deadline_s: float = Field(20.0, gt=0, le=3600, description="With p2p: how long to look for a peer holding a "
                                  "file before fetching it over HTTP.")
    p2p_listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], min_length=1, max_length=8,
                                  description="With p2p: libp2p listen addresses (multiaddrs).")
    p2p_coordinator: list[str] = Field(default_factory=list, max_length=16, description="With p2p: the "
                                       "coordinator peer's multiaddrs, each ending in /p2p/<peer id> (default: "
                                       "what its GET /v1/p2p says).")
    p2p_jobs: bool = Field(False, description="With p2p: send register, lease, release and results to the "
                           "coordinator's libp2p peer (HTTP is the fallback; docs/protocol.md §6b).")

    attach: list[str] = Field(default_factory=list, max_length=16, description="Another coordinator to work for "
                              "beside URL, as URL or URL=SHARE (repeatable; share default 1): one machine, several "
                              "runs, generation handed between them by share (BOINC's resource share). Each has its "
                              "own identity and pinned key under HOME/attached/.")
    share: float = Field(1.0, gt=0, le=1e6, description="URL's resource share beside the --attach runs: a run with "
                         "share 3 gets 3× the generation time of one with share 1 while both have work.")
    keep_models: bool = Field(False, description="With --attach: keep every run's model in memory between its "
                              "turns (BOINC's 'leave tasks in memory while suspended'): no reload each time the "
                              "machine changes runs, at the cost of the sum of the models' memory. Off: only the "
                              "run on the machine holds its model.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return http_url(v)

    @field_validator("attach")
    @classmethod
    def _attached(cls, v: list[str]) -> list[str]:
        for entry in v:
            attached_run(entry)  # ValueError says the expected form
        return v

    @model_validator(mode="after")
    def _each_coordinator_once(self) -> JoinConfig:
        urls = [self.url, *(attached_run(e)[0] for e in self.attach)]
        if len(set(urls)) != len(urls):
            raise ValueError(f"each coordinator once: {', '.join(urls)} names one twice (attach another URL, or drop "
                             f"the repeat)")
        return self

    @field_validator("name", "team")
    @classmethod
    def _printable_name(cls, v: str) -> str:
        return check_printable(v)  # the coordinator refuses control characters in a profile; say so up front

    @field_validator("p2p_coordinator")
    @classmethod
    def _coordinator_maddrs(cls, v: list[str]) -> list[str]:
        # lazy: peer_fetch loads the wire messages (~40 ms of pydantic models) that `join --help` never needs
        from swarm_client.peer_fetch import coordinator_info

        if v:
            coordinator_info(v)  # ValueError says the expected form
        return v

    @model_validator(mode="after")
    def _jobs_need_p2p(self) -> JoinConfig:
        if self.p2p_jobs and not self.p2p:
            raise ValueError("p2p_jobs sends jobs through this client's libp2p peer, which only p2p starts: add --p2p "
                             "(p2p = true), or drop --p2p-jobs")
        return self

    @field_validator("windows")
    @classmethod
    def _windows_parse(cls, v: list[str]) -> list[str]:
        for w in v:
            parse_window(w)  # ValueError says the expected form
        return v
