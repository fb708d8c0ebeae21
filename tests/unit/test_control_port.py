"""The control page keeps its port across restarts (issue 34: a bookmark broke on every start): with
--control-port 0 it listens again on the port it had, and only when that port is taken on another one."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from swarm_client.webcontrol import PORT_FILE, ControlPage, PageSource


def _page(home: Path) -> ControlPage:
    return ControlPage(PageSource(home, lambda: {}, lambda: None))


async def _start(home: Path, port: int = 0) -> tuple[ControlPage, int]:
    page = _page(home)
    await page.start(port)
    return page, page.port


def test_the_page_listens_on_its_last_port_again_unless_it_is_taken(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int, int, int]:
        page, first = await _start(tmp_path)
        await page.stop()
        page, again = await _start(tmp_path)  # restarted: the same address
        await page.stop()
        with socket.socket() as squatter:  # someone else holds it now: the page takes another, and remembers that
            squatter.bind(("127.0.0.1", again))
            squatter.listen()
            page, moved = await _start(tmp_path)
            await page.stop()
        page, pinned = await _start(tmp_path, 0)
        await page.stop()
        return first, again, moved, pinned

    first, again, moved, pinned = asyncio.run(scenario())
    assert again == first and moved != first
    assert pinned == moved and (tmp_path / PORT_FILE).read_text() == str(moved)


def test_an_explicit_port_is_used_as_given_and_not_remembered(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]

    async def scenario() -> int:
        page, port = await _start(tmp_path, free)
        await page.stop()
        return port

    assert asyncio.run(scenario()) == free and not (tmp_path / PORT_FILE).exists()
