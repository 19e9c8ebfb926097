"""kill(-1, SIGKILL): every process this job can see."""

import os
import signal

print("killing every process I can see", flush=True)
os.kill(-1, signal.SIGKILL)
