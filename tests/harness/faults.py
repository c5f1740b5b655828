"""A bad network in user space: an asyncio TCP proxy on loopback between a client and a server,
with the faults a test turns on (this kernel has no netem).

    proxy = FaultProxy(server_port, latency=0.08, jitter=0.05, rate=48_000)
    port = await proxy.start()          # clients connect to 127.0.0.1:port
    proxy.freeze(5.0)                   # nothing moves either way for 5 s
    proxy.cut()                         # every connection through it drops at once
    proxy.stall_downstream()            # the client stops reading: server -> client stops, the
                                        # proxy's socket to the server keeps a tiny receive buffer
    await proxy.close()

Latency delays every chunk by `latency` plus up to `jitter` seconds, in order (a later chunk never
overtakes an earlier one); `rate` caps each direction at that many bytes a second.
"""

from __future__ import annotations

import asyncio
import random
import socket


class FaultProxy:
    def __init__(self, target_port: int, *, latency: float = 0.0, jitter: float = 0.0, rate: float | None = None,
                 seed: int = 0, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.latency, self.jitter, self.rate = latency, jitter, rate
        self.random = random.Random(seed)
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None
        self.connections: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.tasks: set[asyncio.Task] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._downstream = asyncio.Event()   # server -> client may move
        self._downstream.set()
        self.bytes = {"up": 0, "down": 0}
        self.cuts = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def freeze(self, seconds: float) -> None:
        """Nothing moves either way for `seconds` (a frozen Wi-Fi link); then it all flows again."""
        self._flowing.clear()
        asyncio.get_running_loop().call_later(seconds, self._flowing.set)

    def cut(self) -> None:
        """Every open connection drops at once, both sides, without a closing handshake."""
        self.cuts += 1
        for client, upstream in list(self.connections):
            for writer in (client, upstream):
                writer.transport.abort()
        self.connections.clear()

    def stall_downstream(self) -> None:
        """The client stops reading: nothing more from the server reaches it."""
        self._downstream.clear()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a stalled reader backs up at once
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.target)
            up_reader, up_writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.connections.add(pair)
        for task in (self._pump(reader, up_writer, "up", pair), self._pump(up_reader, writer, "down", pair)):
            t = asyncio.ensure_future(task)
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def drop() -> None:   # one side failed: the other learns of it, as over a real network
            for side in pair:
                side.transport.abort()
            self.connections.discard(pair)

        async def deliver():
            try:
                while (item := await queue.get()) is not None:
                    at, data = item
                    await asyncio.sleep(max(0.0, at - loop.time()))
                    await self._flowing.wait()
                    if writer.transport.is_closing():
                        raise ConnectionResetError("the other side is gone")
                    writer.write(data)
                    await writer.drain()
                    if self.rate:
                        await asyncio.sleep(len(data) / self.rate)
                writer.close()
            except (ConnectionError, OSError):
                drop()

        sender = asyncio.ensure_future(deliver())
        last = 0.0
        try:
            while not sender.done():
                while direction == "down" and not self._downstream.is_set():
                    # a stalled client: nothing is read from the server, but a server that drops
                    # the connection meanwhile drops the client's too, as over a real network
                    if reader.exception() is not None or reader.at_eof():
                        raise ConnectionResetError("the server dropped the connection")
                    await asyncio.sleep(0.05)
                data = await reader.read(16384 if direction == "up" else 4096)
                if not data:
                    break
                self.bytes[direction] += len(data)
                last = max(last, loop.time() + self.latency + self.random.uniform(0.0, self.jitter))
                queue.put_nowait((last, data))
            queue.put_nowait(None)
            await sender
        except (ConnectionError, OSError):
            drop()
        except asyncio.CancelledError:
            sender.cancel()
            drop()
