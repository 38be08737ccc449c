"""The identity relay on its own: what it does with the connections it pipes when it stops."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from singularityd.identity import IdentityRelay


async def test_stopping_the_relay_ends_its_connections_without_an_error_logged(tmp_path: Path) -> None:
    """A daemon stopped while a client followed a log (`sing logs -f`) logged a CancelledError
    traceback from the relay's connection handler."""
    upstream = tmp_path / "upstream.sock"
    connected = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()
        writer.close()

    async def target(uid: int, gid: int) -> Path:
        return upstream

    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    server = await asyncio.start_unix_server(hold, path=str(upstream))
    relay = IdentityRelay(tmp_path / "public.sock", target, None, 0o600)
    await relay.start()
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "public.sock"))
    writer.write(b"hello")
    await writer.drain()
    await asyncio.wait_for(connected.wait(), 10)
    await relay.stop()
    assert await asyncio.wait_for(reader.read(), 10) == b"", "the client sees its connection end"
    await asyncio.sleep(0.1)
    writer.close()
    server.close()
    assert errors == []
