"""The egress allow-list: exactly the listed endpoints answer from inside a sandbox."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pandastack_local import LocalServer
from pandastack_local.isolation.egress import EgressError, parse_rule, parse_rules
from tests.support.listener import Listener

PROBE = """
import socket, sys
host, port, payload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    s = socket.create_connection((host, port), timeout=3)
except OSError as e:
    print("UNREACHABLE", type(e).__name__)
    raise SystemExit(0)
s.sendall(b"x" * payload)
s.shutdown(socket.SHUT_WR)
got = b""
while chunk := s.recv(65536):
    got += chunk
print("ANSWER", got[:20].decode(), len(got))
"""


class EchoServer(Listener):
    """A host TCP server that answers ``<tag>:`` followed by everything it received."""

    def __init__(self, host: str, tag: str) -> None:
        self.tag = tag.encode()
        super().__init__(host)

    def handle(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(self.tag + b":" + data)


def host_address() -> str | None:
    """A non-loopback IPv4 address of this host (the default route's), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


@pytest.fixture(scope="module")
def echoes() -> Iterator[dict[str, EchoServer]]:
    servers = {
        "allowed": EchoServer("127.0.0.1", "allowed"),
        "other_port": EchoServer("127.0.0.1", "other"),
    }
    external = host_address()
    if external:
        servers["external"] = EchoServer(external, "external")
        servers["external_unlisted"] = EchoServer(external, "unlisted")
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module")
def egress_server(echoes: dict[str, EchoServer]) -> Iterator[LocalServer]:
    allow = [f"127.0.0.1:{echoes['allowed'].port}"]
    if "external" in echoes:
        ext = echoes["external"]
        allow.append(f"{ext.sock.getsockname()[0]}:{ext.port}")
    # The egress relay is bwrap's (gVisor's sandboxes have no network, and a gVisor server refuses
    # --allow-egress: tests/local/test_gvisor.py), so this server is bwrap under either leg.
    with LocalServer(allow_egress=allow, pool_size=1, isolation="bwrap") as server:
        yield server


def probe(server: LocalServer, host: str, port: int, payload: int = 5) -> str:
    client = server.client()
    sb = client.sandboxes.create(template="base")
    try:
        sb.filesystem.write("/tmp/probe.py", PROBE)
        result = sb.exec(f"python3 /tmp/probe.py {host} {port} {payload}", timeout_seconds=30)
        assert result.exit_code == 0, result.stderr
        return str(result.stdout).strip()
    finally:
        sb.kill()


def test_listed_endpoint_answers_from_inside_at_the_same_address(
    egress_server: LocalServer, echoes: dict[str, EchoServer]
) -> None:
    out = probe(egress_server, "127.0.0.1", echoes["allowed"].port, payload=3 * 1024 * 1024)
    assert out == f"ANSWER allowed:xxxxxxxxxxxx {len('allowed:') + 3 * 1024 * 1024}"


def test_non_listed_port_on_the_same_host_is_unreachable(
    egress_server: LocalServer, echoes: dict[str, EchoServer]
) -> None:
    assert probe(egress_server, "127.0.0.1", echoes["other_port"].port).startswith("UNREACHABLE")
    # The server's own API port is not listed either.
    assert probe(egress_server, "127.0.0.1", egress_server.port).startswith("UNREACHABLE")
    # The allowed port on another loopback address is not the listed endpoint.
    assert probe(egress_server, "127.0.0.2", echoes["allowed"].port).startswith("UNREACHABLE")


def test_non_listed_address_is_unreachable(egress_server: LocalServer, echoes: dict[str, EchoServer]) -> None:
    external = host_address()
    assert external, "this host needs a non-loopback address for the egress test"
    assert probe(egress_server, external, echoes["external_unlisted"].port).startswith("UNREACHABLE")
    # The listed external endpoint itself is reachable only through its loopback port inside.
    assert probe(egress_server, external, echoes["external"].port).startswith("UNREACHABLE")
    assert probe(egress_server, "127.0.0.1", echoes["external"].port) == "ANSWER external:xxxxx 14"


def test_each_sandbox_gets_its_own_listener_and_deleting_closes_it(
    egress_server: LocalServer, echoes: dict[str, EchoServer]
) -> None:
    client = egress_server.client()
    boxes = [client.sandboxes.create(template="base") for _ in range(2)]
    try:
        for sb in boxes:
            sb.filesystem.write("/tmp/probe.py", PROBE)
            out = sb.exec(f"python3 /tmp/probe.py 127.0.0.1 {echoes['allowed'].port} 1", timeout_seconds=30)
            assert out.stdout.strip() == "ANSWER allowed:x 9"
    finally:
        for sb in boxes:
            sb.kill()
    # Several sandboxes later the relay still works: listeners of deleted ones were released.
    assert probe(egress_server, "127.0.0.1", echoes["allowed"].port) == "ANSWER allowed:xxxxx 13"


def test_without_allow_list_nothing_is_reachable(
    local_server: LocalServer, echoes: dict[str, EchoServer]
) -> None:
    assert probe(local_server, "127.0.0.1", echoes["allowed"].port).startswith("UNREACHABLE")


@pytest.mark.parametrize(
    ("spec", "inside", "target"),
    [
        ("127.0.0.1:4200", ("127.0.0.1", 4200), ("127.0.0.1", 4200)),
        ("localhost:4200", ("127.0.0.1", 4200), ("localhost", 4200)),
        ("[::1]:5432", ("::1", 5432), ("::1", 5432)),
        ("10.1.2.3:5432", ("127.0.0.1", 5432), ("10.1.2.3", 5432)),
        ("db.internal:6379", ("127.0.0.1", 6379), ("db.internal", 6379)),
    ],
)
def test_parse_rule(spec: str, inside: tuple[str, int], target: tuple[str, int]) -> None:
    rule = parse_rule(spec)
    assert rule.inside == inside
    assert (rule.target_host, rule.target_port) == target


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ("4200", "HOST:PORT"),
        ("127.0.0.1:http", "1 to 65535"),
        ("127.0.0.1:0", "1 to 65535"),
        ("::1:4200", "brackets"),
    ],
)
def test_bad_rule_names_the_flag_and_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(EgressError, match="--allow-egress") as info:
        parse_rule(spec)
    assert fix in str(info.value)


def test_two_endpoints_on_one_inside_port_are_refused() -> None:
    with pytest.raises(EgressError, match="one endpoint per port"):
        parse_rules(["10.0.0.1:5432", "10.0.0.2:5432"])
    assert len(parse_rules(["127.0.0.1:4200", "127.0.0.1:4200"])) == 1


def test_cli_refuses_a_bad_endpoint() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pandastack_local", "serve", "--allow-egress", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--allow-egress 'nope': expected HOST:PORT" in proc.stderr
