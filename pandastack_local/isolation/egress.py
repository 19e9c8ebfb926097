"""The egress allow-list: exactly the listed host endpoints are reachable from inside a sandbox.

A sandbox's network namespace has loopback only. For each ``--allow-egress HOST:PORT``
the server opens a listening TCP socket *inside* that namespace (a short-lived host
thread enters it with ``setns``, binds, and leaves; the socket stays in the namespace
it was made in), and relays every connection accepted on it to HOST:PORT on the host
side. Nothing runs in the guest for it and no host socket is mounted into the sandbox,
so the job can reach the listed endpoints and nothing else: the host side only ever
connects to the one endpoint each listener was made for.

Where the job finds an endpoint: a loopback HOST (``127.0.0.0/8``, ``::1``,
``localhost``) is served at the same address and port inside, so
``PREFECT_API_URL=http://127.0.0.1:4200/api`` works unchanged in the sandbox; any other
HOST is served at ``127.0.0.1:PORT`` inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from pandastack_local.exceptions import PandaStackLocalError

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
CHUNK_BYTES = 64 * 1024
CONNECT_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS_PER_SANDBOX = 64


class EgressError(PandaStackLocalError, ValueError):
    """An --allow-egress value or a sandbox the relay cannot serve."""


@dataclass(frozen=True)
class EgressRule:
    """One allowed endpoint: where the sandbox connects (inside) and where that goes (target)."""

    target_host: str
    target_port: int
    inside_host: str

    @property
    def inside(self) -> tuple[str, int]:
        return self.inside_host, self.target_port

    def __str__(self) -> str:
        return f"{self.inside_host}:{self.target_port} -> {self.target_host}:{self.target_port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_rule(spec: str) -> EgressRule:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) into a rule, or a clear error naming the fix."""
    text = spec.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise EgressError(f"--allow-egress {spec!r}: expected HOST:PORT, e.g. 127.0.0.1:4200")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise EgressError(f"--allow-egress {spec!r}: write an IPv6 address in brackets, e.g. [::1]:4200")
    try:
        port = int(port_text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise EgressError(f"--allow-egress {spec!r}: PORT must be a number from 1 to 65535")
    if host == "localhost":
        inside = "127.0.0.1"
    elif _is_loopback(host):
        inside = host
    else:
        inside = "127.0.0.1"
    return EgressRule(target_host=host, target_port=port, inside_host=inside)


def parse_rules(specs: Iterable[str]) -> tuple[EgressRule, ...]:
    rules: list[EgressRule] = []
    seen: dict[tuple[str, int], EgressRule] = {}
    for spec in specs:
        rule = parse_rule(spec)
        other = seen.get(rule.inside)
        if other is not None and other != rule:
            raise EgressError(
                f"--allow-egress {spec!r}: inside the sandbox it would take "
                f"{rule.inside_host}:{rule.target_port}, already used by {other.target_host}:"
                f"{other.target_port}; allow only one endpoint per port"
            )
        if other is None:
            seen[rule.inside] = rule
            rules.append(rule)
    return tuple(rules)


def _netns_pid(root_pid: int, descendants: list[int]) -> int:
    """A host pid of a process inside the sandbox's network namespace."""
    own = os.stat("/proc/self/ns/net").st_ino
    for pid in [root_pid, *descendants]:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}/ns/net").st_ino != own:
                return pid
    raise EgressError("sandbox has no process in its own network namespace")


def _listen_in_netns(pid: int, rules: tuple[EgressRule, ...]) -> list[socket.socket]:
    """Bind one listener per rule inside ``pid``'s network namespace (on a throwaway thread:
    ``setns`` changes only the calling thread, which then ends)."""
    result: list[socket.socket] = []
    failure: list[BaseException] = []

    def enter_and_bind() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise EgressError(
                        f"cannot enter the sandbox's network namespace ({os.strerror(err)}): "
                        "--allow-egress needs the server to run as root"
                    )
            finally:
                os.close(fd)
            for rule in rules:
                family = socket.AF_INET6 if ":" in rule.inside_host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                result.append(sock)
                sock.bind(rule.inside)
                sock.listen(64)
                sock.setblocking(False)
        except (OSError, EgressError) as exc:  # reported on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=enter_and_bind, name="egress-setns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        for sock in result:
            sock.close()
        exc = failure[0]
        if isinstance(exc, EgressError):
            raise exc
        raise EgressError(f"egress listener in the sandbox failed: {exc}") from exc
    return result


@dataclass
class _Attached:
    servers: list[asyncio.Server] = field(default_factory=list)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    # Connections being relayed now (counted from their accept, before the upstream connect).
    relayed: int = 0


class EgressRelay:
    """Per-sandbox listeners for the allow-list, relayed on the server's event loop."""

    def __init__(self, rules: tuple[EgressRule, ...]) -> None:
        self.rules = rules
        self._attached: dict[str, _Attached] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __bool__(self) -> bool:
        return bool(self.rules)

    async def attach(self, name: str, root_pid: int, descendants: list[int]) -> None:
        """Open the sandbox's inside endpoints; call before anyone can use the sandbox."""
        if not self.rules:
            return
        self._loop = asyncio.get_running_loop()
        pid = _netns_pid(root_pid, descendants)
        sockets = await asyncio.to_thread(_listen_in_netns, pid, self.rules)
        entry = _Attached()
        self._attached[name] = entry
        try:
            for rule, sock in zip(self.rules, sockets, strict=True):
                handler = functools.partial(self._relay, entry, rule)
                entry.servers.append(await asyncio.start_server(handler, sock=sock))
        except BaseException:
            self._close(name)
            for sock in sockets:
                sock.close()
            raise

    def detach(self, name: str) -> None:
        """Close the sandbox's listeners and connections (thread-safe: kill runs off-loop)."""
        if name not in self._attached or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._close(name)
        elif not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._close, name)

    def _close(self, name: str) -> None:
        entry = self._attached.pop(name, None)
        if entry is None:
            return
        for server in entry.servers:
            server.close()
        for writer in list(entry.writers):
            writer.close()

    async def _relay(
        self,
        entry: _Attached,
        rule: EgressRule,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        if entry.relayed >= MAX_CONNECTIONS_PER_SANDBOX:  # the documented cap: refused at once
            log.info("egress %s: refused, %d connections already relayed", rule, entry.relayed)
            writer.close()
            return
        entry.relayed += 1
        entry.writers.add(writer)
        writers = [writer]
        try:
            up_reader, upstream = await asyncio.wait_for(
                asyncio.open_connection(rule.target_host, rule.target_port), CONNECT_TIMEOUT_SECONDS
            )
            writers.append(upstream)
            entry.writers.add(upstream)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("egress %s: %s", rule, exc)
        finally:
            entry.relayed -= 1
            for w in writers:
                entry.writers.discard(w)
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close, so request/response protocols see the end."""
    try:
        while chunk := await reader.read(CHUNK_BYTES):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()
