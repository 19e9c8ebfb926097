"""Write a 4 GiB file to the path named in fill_target (beside this file), 1 MiB at a time."""

import os

with open("fill_target") as f:
    path = f.read().strip()
chunk = b"x" * (1 << 20)
written = 0
try:
    with open(path, "wb") as f:
        for _ in range(4 * 1024):
            f.write(chunk)
            written += 1
        f.flush()
        os.fsync(f.fileno())
finally:
    print("MiB written:", written, flush=True)
