"""Start 5,000 threads."""

import threading

started = 0
stop = threading.Event()
try:
    for _ in range(5000):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
finally:
    print("threads started:", started, flush=True)
