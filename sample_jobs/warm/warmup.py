"""The expensive preamble, paid once in the warm parent: build a lookup 'model' and keep it.

The model lives in memory, in a long-lived process that serves it on a unix socket
(/tmp/model.sock), and on disk (/work/model.json). A fork under gVisor copies the
parent's memory, so each child finds the loaded model still running; a fork under
bwrap copies the disk only, and score.py falls back to the file.
"""

import json
import os
import subprocess
import sys
import time

SERVE = """
import json, os, socket, sys
model = json.load(open("/work/model.json"))  # loaded once, kept in this process's memory
model["served_by"] = os.getpid()
payload = json.dumps(model).encode()
sock = socket.socket(socket.AF_UNIX)
sock.bind("/tmp/model.sock")
sock.listen(16)
open("/tmp/model.ready", "w").close()
while True:
    conn, _ = sock.accept()
    conn.sendall(payload)
    conn.close()
"""

time.sleep(2)  # stands in for loading a model or warming a dataset
model = {"weights": [((i * 7919) % 101) / 100 for i in range(1000)], "built_at": time.time()}
json.dump(model, open("/work/model.json", "w"))
# The agent owns this process (no `runsc exec`), so a gVisor checkpoint can copy it.
subprocess.Popen(
    [sys.executable, "-c", SERVE],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
)
for _ in range(200):
    if os.path.exists("/tmp/model.ready"):
        break
    time.sleep(0.05)
json.dump({"warm": True, "built_at": model["built_at"]}, open("/work/result.json", "w"))
