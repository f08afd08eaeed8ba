"""Endpoints that misbehave the way a wedged or hostile server does, for the prober's tests and the scale
benchmark: accept and never answer, trickle an answer a byte at a time, or send a body too large to read.

Each is a real loopback socket served from its own thread (its own event loop), so the code under test can
run in any loop or process; any path answers the same, so one server stands for many endpoints
(`url/0`, `url/1`, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

from support.cluster.waiting import LOOPBACK

# A 200 whose body, sent a byte at a time, takes far longer than any probe deadline.
TRICKLE = b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + b"x" * 4096


class HostileEndpoint:
    """With `answer=None`: accepts connections, reads requests, never answers (a server wedged in a long
    forward pass). Otherwise answers every request with `answer`, a byte every `pause` seconds if set."""

    def __init__(self, answer: bytes | None = None, pause: float = 0.0) -> None:
        self._answer = answer
        self._pause = pause
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hostile-endpoint", daemon=True)
        self._thread.start()
        serving = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, LOOPBACK, 0), self._loop
        )
        self._server = serving.result(timeout=10)
        self.url = f"http://{LOOPBACK}:{self._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> str:
        return self.url

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        task = self._loop.create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            if self._answer is None:
                while await reader.read(65536):
                    pass
                return
            await reader.readuntil(b"\r\n\r\n")
            if not self._pause:
                writer.write(self._answer)
                await writer.drain()
            for byte in self._answer if self._pause else b"":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(self._pause)
        writer.close()

    def close(self) -> None:
        async def shut() -> None:
            for task in list(self._tasks):
                task.cancel()
            for writer in self._writers:
                writer.close()
            self._server.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
