"""A TCP proxy on 127.0.0.1 that adds a round-trip delay in front of a loopback server (nginx,
moto's S3 server), so that the loader benchmark can show how the remote loaders cope with a
cloud object store's latency where kernel traffic shaping (tc netem) is not available.

It is a delay line, not a bandwidth limit: every chunk forwarded, either way, is delivered
`latency_ms / 2` after it arrived, in order per connection, and chunks arriving back to back
keep their throughput. A request and its response thus cost one extra `latency_ms`. Opening a
connection costs one more, as TCP's handshake does: the client's connect() returns at once
(the kernel answers it), so its first bytes are instead held until the handshake would have
completed. Closing or resetting one side closes the other.

    with LatencyProxy("127.0.0.1", 8080, latency_ms=25) as proxy:
        fetch(proxy.url + "/train/shard-000000.tar")
        print(proxy.counters())

    python benchmarks/latency_proxy.py --upstream 127.0.0.1:8080 --latency-ms 25 [--port P]

The proxy runs its own asyncio loop in a background thread, so the process that starts it can
do anything else, including blocking reads through it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import sys
import threading

CHUNK = 1 << 20            # the most read from a socket at once
# Bytes held in one direction of one connection before it stops reading (as a TCP window does):
# the delay line's throughput is at most WINDOW / (latency / 2), about 5 GB/s at 25 ms.
WINDOW = 64 << 20


class LatencyProxy:
    """Forwards 127.0.0.1:`port` (0: any free port) to `upstream_host`:`upstream_port` with
    `latency_ms` of added round-trip time. Counts, readable at any time: `connections`
    (accepted), `open_connections`, `bytes_to_upstream`, `bytes_to_client` (delivered)."""

    def __init__(self, upstream_host: str, upstream_port: int, latency_ms: float, port: int = 0):
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be 0 or more, not {latency_ms}")
        self.upstream_host, self.upstream_port = upstream_host, int(upstream_port)
        self.latency_ms = float(latency_ms)
        self.port = int(port)
        self.connections = self.open_connections = 0
        self.bytes_to_upstream = self.bytes_to_client = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> dict:
        return {"latency_ms": self.latency_ms, "connections": self.connections,
                "bytes_to_upstream": self.bytes_to_upstream, "bytes_to_client": self.bytes_to_client}

    def start(self) -> "LatencyProxy":
        if self._thread is not None:
            raise RuntimeError("the proxy is already running")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"latency-proxy-{self.port}", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        self._loop, self._thread = loop, thread
        return self

    def stop(self) -> None:
        """Closes the listening socket and every connection through the proxy; idempotent."""
        if self._thread is None:
            return
        loop, thread = self._loop, self._thread
        try:
            asyncio.run_coroutine_threadsafe(self._shut(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> "LatencyProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _listen(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, limit=CHUNK, backlog=1024)
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            raise OSError(error.errno, f"cannot listen on 127.0.0.1:{self.port}: {reason}") from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shut(self) -> None:
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()    # from 3.12 this also waits for the connections, hence after them

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        self.connections += 1
        self.open_connections += 1
        try:
            await self._forward(client_reader, client_writer)
        except asyncio.CancelledError:
            pass    # stop(): on 3.11, asyncio's stream callback raises on a handler task that ends cancelled
        finally:
            self.open_connections -= 1
            self._handlers.discard(task)

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        half = self.latency_ms / 2000
        ready = loop.time() + 2 * half          # the handshake's round trip
        upstream_writer = None
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self.upstream_host, self.upstream_port, limit=CHUNK)
            except OSError:
                await asyncio.sleep(max(0.0, ready - loop.time()))   # a refused connect also takes its round trip
                return
            directions = [asyncio.create_task(_DelayLine(client_reader, upstream_writer, ready, half, self,
                                                         "bytes_to_upstream").run()),
                          asyncio.create_task(_DelayLine(upstream_reader, client_writer, ready, half, self,
                                                         "bytes_to_client").run())]
            try:
                done, _ = await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done):
                    client_writer.transport.abort()     # a reset or a write to a closed peer ends both sides
                    upstream_writer.transport.abort()
            finally:
                for t in directions:
                    t.cancel()
                await asyncio.gather(*directions, return_exceptions=True)
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()


class _DelayLine:
    """One direction of one connection: what `reader` gives is written to `writer` `half`
    seconds after it arrived (and not before `ready`); its end, as a half-close, likewise."""

    def __init__(self, reader, writer, ready: float, half: float, proxy: LatencyProxy, counter: str):
        self.reader, self.writer, self.ready, self.half = reader, writer, ready, half
        self.proxy, self.counter = proxy, counter
        self.queue: collections.deque = collections.deque()   # (deadline, bytes | None at the end | OSError)
        self.held = 0
        self.arrived = asyncio.Event()
        self.room = asyncio.Event()

    async def run(self) -> None:
        receiving = asyncio.create_task(self._receive())
        try:
            await self._deliver()
        finally:
            receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self.reader.read(CHUNK)
            except OSError as error:            # a reset travels down the line as the data does
                data = error
            self.queue.append((max(loop.time(), self.ready) + self.half, data or None))
            self.arrived.set()
            if not isinstance(data, bytes) or not data:
                return
            self.held += len(data)
            while self.held > WINDOW:
                self.room.clear()
                await self.room.wait()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.arrived.clear()
                await self.arrived.wait()
            deadline, data = self.queue[0]
            wait = deadline - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            if data is None:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            if isinstance(data, OSError):
                raise data
            self.writer.write(data)
            self.held -= len(data)
            self.room.set()
            setattr(self.proxy, self.counter, getattr(self.proxy, self.counter) + len(data))
            await self.writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the server to put behind the delay")
    parser.add_argument("--latency-ms", type=float, required=True, help="added round-trip time, in milliseconds")
    parser.add_argument("--port", type=int, default=0, help="port to listen on, on 127.0.0.1 (default: any free one)")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--upstream must be HOST:PORT, not {args.upstream!r}")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be 0 or more, not {args.latency_ms}")
    proxy = LatencyProxy(host, int(port), args.latency_ms, port=args.port)
    try:
        proxy.start()
    except OSError as error:
        sys.exit(f"latency_proxy: {error.strerror or error}")
    print(f"{proxy.url} -> {args.upstream} with {args.latency_ms:g} ms added round trip (Ctrl-C stops it)", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    print(f"{proxy.connections} connections, {proxy.bytes_to_upstream} bytes to upstream, "
          f"{proxy.bytes_to_client} bytes to clients", flush=True)


if __name__ == "__main__":
    main()
