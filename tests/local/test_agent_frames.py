"""The host's side of the agent protocol holds its caps and checks its JSON whatever answers.

A fake agent on a Unix socket (no sandbox) sends what a hostile guest could: more data than
asked for, a listing that is not a list, a reply that is not JSON, an error reply.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pandastack_local import agent_client
from pandastack_local.guest.agent import DATA, JSON, TOO_BIG, pack, pack_json


def answer(tmp_path: Path, frames: list[bytes], call: object) -> object:
    """Run ``call(socket_path)`` against an agent that answers any request with ``frames``."""
    path = tmp_path / "agent.sock"

    async def main() -> object:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            header = await reader.readexactly(5)
            await reader.readexactly(int.from_bytes(header[1:], "big"))
            writer.write(b"".join(frames))
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(serve, str(path))
        async with server:
            return await call(path)  # type: ignore[operator]

    return asyncio.run(main())


def test_header_layout_is_what_the_fake_agent_reads() -> None:
    frame = pack(DATA, b"abc")
    assert len(frame) == 5 + 3 and frame[0] == DATA and int.from_bytes(frame[1:5], "big") == 3


def test_read_file_joins_the_data_and_counts_it_here(tmp_path: Path) -> None:
    ok = [pack(DATA, b"ab"), pack(DATA, b"cd"), pack_json({"ok": True})]
    assert answer(tmp_path, ok, lambda p: agent_client.read_file(p, "/f", max_bytes=4)) == b"abcd"
    over = [pack(DATA, b"ab"), pack(DATA, b"cde"), pack_json({"ok": True})]
    with pytest.raises(agent_client.AgentError, match="over the 4-byte read cap") as info:
        answer(tmp_path, over, lambda p: agent_client.read_file(p, "/f", max_bytes=4))
    assert info.value.errno == TOO_BIG


def test_an_error_reply_is_raised_as_the_agents_error(tmp_path: Path) -> None:
    frames = [pack_json({"error": "no such file", "errno": 2})]
    with pytest.raises(agent_client.AgentError, match="no such file"):
        answer(tmp_path, frames, lambda p: agent_client.read_file(p, "/f"))


@pytest.mark.parametrize(
    ("listing", "message"),
    [(b"[1", "a listing that is not JSON"), (b'{"a": 1}', "a listing that is not a list")],
)
def test_a_listing_that_is_not_a_json_list_is_refused(tmp_path: Path, listing: bytes, message: str) -> None:
    frames = [pack(DATA, listing), pack_json({"ok": True})]
    with pytest.raises(agent_client.AgentUnavailable, match=message):
        answer(tmp_path, frames, lambda p: agent_client.list_dir(p, "/"))
    over = [pack(DATA, b"[" + b"1," * 10 + b"1]"), pack_json({"ok": True})]
    with pytest.raises(agent_client.AgentError, match="over the 8-byte cap"):
        answer(tmp_path, over, lambda p: agent_client.list_dir(p, "/", max_bytes=8))


@pytest.mark.parametrize(("reply", "message"), [(b"{", "not JSON"), (b"[]", "not a JSON object")])
def test_a_reply_that_is_not_a_json_object_is_refused(tmp_path: Path, reply: bytes, message: str) -> None:
    with pytest.raises(agent_client.AgentUnavailable, match=f"a reply that is {message}"):
        answer(tmp_path, [pack(JSON, reply)], lambda p: agent_client.call(p, {"op": "x"}))


async def _streamed(path: Path, max_bytes: int) -> list[bytes]:
    conn, chunks = await agent_client.stream_file(path, "/f", max_bytes, 64 * 1024)
    try:
        return [chunk async for chunk in chunks]
    finally:
        conn.close()


def test_a_streamed_read_counts_its_bytes_here_and_refuses_a_frame_no_agent_sends(tmp_path: Path) -> None:
    """GET fs streams (tests/security/test_transfer_memory.py): the cap is counted here whatever
    answers, an error reply is the agent's error, and a frame larger than a few of the agent's
    chunks (it sends 64 KiB ones) is refused rather than buffered."""
    ok = [pack(DATA, b"ab"), pack(DATA, b"cd"), pack_json({"ok": True})]
    assert answer(tmp_path, ok, lambda p: _streamed(p, 4)) == [b"ab", b"cd"]
    over = [pack(DATA, b"ab"), pack(DATA, b"cde"), pack_json({"ok": True})]
    with pytest.raises(agent_client.AgentError, match="over the 4-byte read cap") as info:
        answer(tmp_path, over, lambda p: _streamed(p, 4))
    assert info.value.errno == TOO_BIG
    with pytest.raises(agent_client.AgentError, match="no such file"):
        answer(tmp_path, [pack_json({"error": "no such file", "errno": "ENOENT"})], lambda p: _streamed(p, 4))
    huge = [pack(DATA, b"x" * (512 * 1024)), pack_json({"ok": True})]
    with pytest.raises(agent_client.AgentUnavailable, match="oversized frame"):
        answer(tmp_path, huge, lambda p: _streamed(p, 1 << 20))
