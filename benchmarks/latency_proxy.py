"""A TCP proxy on 127.0.0.1 that adds a round-trip delay in front of a loopback server (nginx,
moto's S3 server), so that the loader benchmark can show how the remote loaders cope with a
cloud object store's latency where kernel traffic shaping (tc netem) is not available.

It is a delay line, not a bandwidth limit: every chunk forwarded, either way, is delivered
`latency_ms / 2` after it arrived, in order per connection, and chunks arriving back to back
keep their throughput. A request and its response thus cost one extra `latency_ms`. Opening a
connection costs one more, as TCP's handshake does: the client's connect() returns at once
(the kernel answers it), so its first bytes are instead held until the handshake would have
completed. Closing or resetting one side closes the other. With `flip_first=N` it also damages
answers as a faulty NIC or proxy does while TCP's checksum still passes: one bit flipped in the
body of each of the first N chunks of ranged answers (206) the server sends (`flipped` counts
them), for the tests of verified reads; `flip_at` is where in the chunk's body, as a share of it
(a sample's range holds tar headers too, which no reader checks or decodes).

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

# Bytes held in one direction of one connection before it stops reading (as a TCP window does):
# the delay line's throughput is at most WINDOW / (latency / 2), about 5 GB/s at 25 ms.
WINDOW = 64 << 20


class LatencyProxy:
    """Forwards 127.0.0.1:`port` (0: any free port) to `upstream_host`:`upstream_port` with
    `latency_ms` of added round-trip time. Counts, readable at any time: `connections`
    (accepted), `open_connections`, `bytes_to_upstream`, `bytes_to_client` (delivered)."""

    def __init__(self, upstream_host: str, upstream_port: int, latency_ms: float, port: int = 0, flip_first: int = 0,
                 flip_at: float = 0.5):
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be 0 or more, not {latency_ms}")
        self.upstream_host, self.upstream_port = upstream_host, int(upstream_port)
        self.latency_ms = float(latency_ms)
        self.port = int(port)
        self.connections = self.open_connections = 0
        self.bytes_to_upstream = self.bytes_to_client = 0
        self.flip_first, self.flip_at, self.flipped = flip_first, flip_at, 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._live: set[_Connection] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def damaged(self, data: bytes, side: "_Side") -> bytes:
        """`data` from the server, with one bit flipped in the body of a ranged answer if its turn has come."""
        status = data.rfind(b"HTTP/1.1 ")
        if status >= 0:
            side.ranged = data[status + 9:status + 12] == b"206"
        body = data.find(b"\r\n\r\n", max(status, 0)) + 4 if status >= 0 else 0
        if self.flipped >= self.flip_first or not side.ranged or len(data) - body < 64:
            return data
        self.flipped += 1
        at = body + int((len(data) - body) * self.flip_at)
        return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]

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
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _Connection(self).client, "127.0.0.1", self.port,
                                                    backlog=1024)
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            raise OSError(error.errno, f"cannot listen on 127.0.0.1:{self.port}: {reason}") from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shut(self) -> None:
        self._server.close()
        for connection in list(self._live):
            connection.abort()
        await self._server.wait_closed()


_EOF, _CLOSE, _RESET = "eof", "close", "reset"      # a side's end, delivered as its bytes are


class _Connection:
    """One client connection and its upstream one. Its round trip starts when accepted: the
    client's bytes are held until then (as TCP's handshake would), and a refused upstream
    closes the client after it."""

    def __init__(self, proxy: LatencyProxy):
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.half = proxy.latency_ms / 2000
        self.ready = self.loop.time() + 2 * self.half
        self.client, self.upstream = _Side(self, "bytes_to_upstream"), _Side(self, "bytes_to_client")
        self.client.peer, self.upstream.peer = self.upstream, self.client
        self.live = 0
        self._connecting: asyncio.Task | None = None

    def opened(self, side: "_Side") -> None:
        self.live += 1
        if side is self.client:
            self.proxy.connections += 1
            self.proxy.open_connections += 1
            self.proxy._live.add(self)
            self._connecting = self.loop.create_task(self._connect())

    def lost(self, side: "_Side") -> None:
        self.live -= 1
        if self.live == 0 and self in self.proxy._live:
            self.proxy.open_connections -= 1
            self.proxy._live.discard(self)
            if self._connecting is not None:
                self._connecting.cancel()

    async def _connect(self) -> None:
        try:
            await self.loop.create_connection(lambda: self.upstream, self.proxy.upstream_host,
                                              self.proxy.upstream_port)
        except OSError:
            await asyncio.sleep(max(0.0, self.ready - self.loop.time()))   # a refused connect also takes its round trip
            self.client.transport.close()
            return
        self.client.flow()
        self.client.schedule()

    def abort(self) -> None:
        for side in (self.client, self.upstream):
            if side.transport is not None:
                side.transport.abort()


class _Side(asyncio.Protocol):
    """One socket of a connection: what it receives is written to the other side's socket
    `half` seconds after it arrived (and not before the connection's `ready`), in order, and so
    is its end (an EOF, a close or a reset). Protocol callbacks and timers, no streams: at a
    loader's rate the copies of a stream reader cost the CPU the benchmark measures. It stops
    reading while WINDOW bytes wait in it or the other socket cannot take more, as TCP would."""

    def __init__(self, connection: _Connection, counter: str):
        self.connection, self.counter = connection, counter
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.queue: collections.deque = collections.deque()    # (deadline, bytes or an end)
        self.held = 0
        self.peer_full = False
        self.reading = True
        self.got_eof = self.sent_eof = False    # both: nothing more goes either way, and the socket is closed
        self._timer: asyncio.TimerHandle | None = None
        self.ranged = False         # the server's answer under way is a ranged one (206)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connection.opened(self)
        self.flow()

    def data_received(self, data: bytes) -> None:
        if self.counter == "bytes_to_client":
            data = self.connection.proxy.damaged(data, self)
        self._later(data)
        self.held += len(data)
        self.flow()

    def eof_received(self) -> bool:
        self._later(_EOF)
        self.got_eof = True
        if self.sent_eof:
            self.transport.close()
        return True          # keep writing the other way: a half-close

    def connection_lost(self, exc) -> None:
        self._later(_RESET if exc is not None else _CLOSE)
        self.connection.lost(self)

    def pause_writing(self) -> None:        # this socket's send buffer is full: the other side waits
        self.peer.peer_full = True
        self.peer.flow()

    def resume_writing(self) -> None:
        self.peer.peer_full = False
        self.peer.flow()

    def flow(self) -> None:
        """Reads while there is room, and only once the other side is connected."""
        if self.transport is None or self.transport.is_closing():
            return
        wanted = self.held <= WINDOW and not self.peer_full and self.peer.transport is not None
        if wanted != self.reading:
            (self.transport.resume_reading if wanted else self.transport.pause_reading)()
            self.reading = wanted

    def _later(self, item) -> None:
        loop = self.connection.loop
        self.queue.append((max(loop.time(), self.connection.ready) + self.connection.half, item))
        self.schedule()

    def schedule(self) -> None:
        if self._timer is None and self.queue and self.peer.transport is not None:
            self._timer = self.connection.loop.call_at(self.queue[0][0], self._deliver)

    def _deliver(self) -> None:
        self._timer = None
        out, now = self.peer.transport, self.connection.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if isinstance(item, bytes):
                self.held -= len(item)
                if not out.is_closing():
                    out.write(item)
                    proxy = self.connection.proxy
                    setattr(proxy, self.counter, getattr(proxy, self.counter) + len(item))
            elif item == _EOF:
                if not out.is_closing() and out.can_write_eof():
                    try:
                        out.write_eof()
                    except OSError:        # the peer reset the connection meanwhile: nothing left to end
                        out.abort()
                        continue
                    self.peer.sent_eof = True
                    if self.peer.got_eof:
                        out.close()
            elif item == _CLOSE:
                out.close()
            else:
                out.abort()
        self.flow()
        self.schedule()


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
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):     # set before the URL is out: a signal right after it counts
        signal.signal(signum, lambda *_: stopped.set())
    print(f"{proxy.url} -> {args.upstream} with {args.latency_ms:g} ms added round trip (Ctrl-C stops it)", flush=True)
    try:
        # Timed: handlers run in the main thread, which an untimed wait leaves asleep when the kernel hands
        # the signal to one of the proxy's threads.
        while not stopped.wait(0.5):
            pass
    finally:
        proxy.stop()
    print(f"{proxy.connections} connections, {proxy.bytes_to_upstream} bytes to upstream, "
          f"{proxy.bytes_to_client} bytes to clients", flush=True)


if __name__ == "__main__":
    main()
