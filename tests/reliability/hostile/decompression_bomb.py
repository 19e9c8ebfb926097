"""Inflate a 64 KiB zlib bomb (bomb.z, 64 MiB inflated) 100 times in memory: 6.4 GiB."""

import zlib

with open("bomb.z", "rb") as f:
    bomb = f.read()
print("bomb is", len(bomb), "bytes", flush=True)
inflated = [zlib.decompress(bomb) for _ in range(100)]
print("inflated everything: no wall", flush=True)
