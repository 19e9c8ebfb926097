"""A neighbour that leaves secret files (named after argv[1]) in /work, /tmp and /root, then
stays alive for argv[2] seconds: the escape probe must not find them."""

import json
import os
import sys
import time

token = sys.argv[1]
for d in ("/work", "/tmp", "/root"):
    with open(f"{d}/secret-{token}", "w") as f:
        f.write("sibling secret")
print("secret written", flush=True)
time.sleep(float(sys.argv[2]))
with open(os.environ["JOB_RESULT"], "w") as f:
    json.dump({"sibling": "ok"}, f)
