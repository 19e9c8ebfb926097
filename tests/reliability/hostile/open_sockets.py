"""Open TCP sockets and socket pairs until something stops it."""

import socket

socks = []
try:
    while True:
        socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        if len(socks) % 2:
            socks.extend(socket.socketpair())
finally:
    print("sockets opened:", len(socks), flush=True)
