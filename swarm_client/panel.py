"""What the volunteer sees: a live rich panel on a terminal, plain log lines otherwise (a service, a pipe, CI).

The runner only calls :meth:`Display.say` (an event worth a line of its own) and :meth:`Display.update`
(the counters changed). On a terminal the panel redraws twice a second and events scroll above it; without
a terminal each finished job gives one line, so logs stay greppable.

One process working for several coordinators (`join URL --attach URL2=SHARE`) draws one panel, URL's: it lists
every run in a table (its share, state, results and credit), and the other runs' displays relay their lines and
redraws to it (:meth:`Display.relay`) — two live panels on one terminal would erase each other's lines.

Lines carry text the client did not write (a coordinator's refusal message, a job id, a GPU name), so every
line and every panel value is shown with control characters escaped (shared.safe_text) and never as rich
markup: a coordinator cannot clear the volunteer's screen, move the cursor or plant a hyperlink. (Event lines keep
their newlines, which the client's own multi-line messages need.)
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from typing import IO, Any, Protocol

from shared.safe_text import escape


class StatsView(Protocol):
    client_id: str
    version: int
    accepted: int
    rejected: int
    credit: float
    last_job: str
    tokens_per_s: float
    state: str
    download: str
    p2p: dict[str, int]
    bandwidth: str
    job_steps: int
    job_expected_steps: int
    notices: list[dict[str, Any]]


def software_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("echo-swarm")
    except PackageNotFoundError:
        return "source"


def status_line(s: StatsView) -> str:
    return escape(f"[echo-swarm {s.client_id[:8]}] v{s.version} {s.state} {s.last_job} | {s.tokens_per_s:,.0f} tok/s | "
            f"accepted {s.accepted} rejected {s.rejected} | credit {s.credit:,.0f}")


def whole_writes(stream: IO[str]) -> IO[str]:
    """``stream``, or a line-buffered text stream over its descriptor where ``stream`` writes through a raw file.

    Python's unbuffered stdout (``python -u``, PYTHONUNBUFFERED=1, usual in containers) hands each write to one
    ``write(2)``; when a signal — the volunteer's Ctrl-C — interrupts it while the terminal is slow to read, the
    kernel returns a partial count and the rest of the text is dropped. The panel's redraw then moves up the full
    height it believes it drew and erases lines above it: the notice or the error the volunteer should have read.
    A buffered writer writes the rest."""
    if not isinstance(getattr(stream, "buffer", None), io.RawIOBase):
        return stream  # buffered already (the default), or no descriptor at all
    return open(stream.fileno(), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                errors="replace", closefd=False)


class Display:
    def __init__(self, stats: StatsView, *, live: bool | None = None, url: str = "", hardware: str = "") -> None:
        self.stats = stats
        self.live = sys.stdout.isatty() if live is None else live
        self.url = url
        self.hardware = hardware
        self.software = software_version()
        self.page_url = ""  # the local control page, once it listens
        self._live: Any = None
        self._console: Any = None
        self._err_console: Any = None
        self._last_line = ""
        self._relay: Display | None = None
        #: with several runs in one process: every run's standing (swarm_client/reporting.py ``Reporter.runs``)
        self.runs: Callable[[], list[dict[str, Any]]] | None = None

    def relay(self, to: Display) -> None:
        """An attached run's display: where ``to`` is a live panel, lines and redraws go through it (a line
        printed beside the panel would be erased by its next redraw, and the panel already shows this run's
        counters) — before it starts and after it stops as well, so no run prints a plain status line on the
        panel's terminal; where there is no terminal this display prints plain lines of its own."""
        self._relay = to

    def _through(self) -> Display | None:
        return self._relay if self._relay is not None and self._relay.live else None

    def start(self) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.live import Live

        self._console = Console(file=whole_writes(sys.stdout))
        self._err_console = Console(file=whole_writes(sys.stderr), stderr=True)
        self._live = Live(self, console=self._console, refresh_per_second=2, transient=False)
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def say(self, text: str) -> None:
        """One event line (or a few: the client's own messages may span lines, so ``\n`` is kept and every other
        control character is escaped in each line)."""
        if (through := self._through()) is not None:
            return through.say(text)
        text = "\n".join(escape(line) for line in text.split("\n"))
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def error(self, text: str) -> None:
        """An error or warning line, on stderr; above the panel when stderr is the panel's terminal. It goes
        through the live display there: written to the terminal directly, it landed below the panel, and the next
        redraw (which moves up the panel's height and erases) wiped it, so a banned client's reason was never
        seen. Redirected, stderr gets the plain line and the screen is not touched."""
        if (through := self._through()) is not None:
            return through.error(text)
        text = "\n".join(escape(line) for line in text.split("\n"))
        if self._live is not None and self._err_console is not None and self._err_console.is_terminal:
            self._live.console.print(text, markup=False, highlight=False, style="red")
        else:
            print(text, file=sys.stderr, flush=True)

    def update(self, *, line: bool = False) -> None:
        """Counters changed; ``line``: also worth a log line when there is no panel (a job finished)."""
        if (through := self._through()) is not None:
            return through.update()
        if self._live is not None:
            self._live.refresh()
        elif line:
            text = status_line(self.stats)
            if text != self._last_line:
                print(text, flush=True)
                self._last_line = text

    def __rich__(self) -> Any:
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        s = self.stats
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right")
        grid.add_column()
        state_style = {"generating": "green", "paused": "yellow", "coordinator paused": "yellow", "stopped": "red"}.get(
            s.state, "yellow" if s.state.startswith(("run finished", "coordinator unreachable", "snoozed")) else "white")
        grid.add_row("state", Text(escape(s.state), style=state_style))  # Text, not markup: never parsed
        grid.add_row("coordinator", Text(escape(self.url)))
        grid.add_row("client", s.client_id[:16])
        grid.add_row("policy version", str(s.version) if s.version >= 0 else "-")
        job = s.last_job or "-"
        if s.state == "generating" and s.job_expected_steps:
            job += f"  (≥ {min(99, 100 * s.job_steps // s.job_expected_steps)} % done)"  # stops end rollouts early
        grid.add_row("current job", Text(escape(job)))
        if s.download:
            grid.add_row("downloading", Text(escape(s.download), style="magenta"))
        if s.p2p:
            grid.add_row("peers", f"served {s.p2p.get('served_bytes', 0) / 1e6:,.0f} MB · received "
                                  f"{s.p2p.get('received_bytes', 0) / 1e6:,.0f} MB")
        grid.add_row("tokens/s", f"{s.tokens_per_s:,.1f}")
        grid.add_row("accepted / rejected", Text.assemble((str(s.accepted), "green"), " / ", (str(s.rejected), "red")))
        grid.add_row("credit", f"{s.credit:,.1f}")
        if s.bandwidth:
            grid.add_row("data", Text(escape(s.bandwidth)))
        if s.notices:  # the newest of the coordinator's notices (each was also printed above the panel when new)
            newest = str(s.notices[-1].get("line", "")).removeprefix("notice from the coordinator")
            more = f"  (+{len(s.notices) - 1} more: `echo-swarm client status`)" if len(s.notices) > 1 else ""
            grid.add_row("notice", Text(escape(newest.lstrip(": ")) + more, style="bold yellow"))
        if self.hardware:
            grid.add_row("machine", Text(escape(self.hardware)))
        if self.page_url:
            grid.add_row("control page", Text(escape(self.page_url.split("?")[0])))
        body: Any = grid
        if self.runs is not None:
            from rich.console import Group

            body = Group(grid, Text(""), runs_table(self.runs()))
        return Panel(body, title=f"echo-swarm {self.software}",
                     subtitle="Ctrl-C: stop · `echo-swarm client pause` / `finish` / `open`", border_style="blue")


def runs_table(runs: list[dict[str, Any]]) -> Any:
    """Every run of a client working for several coordinators: its share of the machine (and of the work so far,
    BOINC's resource share), what it is doing, its results and credit — the first run is the one above."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1), header_style="bold cyan", show_edge=False)
    for name, justify in (("coordinator", "left"), ("share", "right"), ("work so far", "right"), ("state", "left"),
                          ("accepted / rejected", "right"), ("credit", "right")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for run in runs:
        table.add_row(Text(escape(str(run.get("url", "")))), f"{float(run.get('share', 0)):g}",
                      f"{100 * float(run.get('work_fraction', 0)):.0f} %", Text(escape(str(run.get("state", "")))),
                      Text.assemble((str(run.get("accepted", 0)), "green"), " / ", (str(run.get("rejected", 0)), "red")),
                      f"{float(run.get('credit', 0)):,.1f}")
    return table
