"""HOSTILE on purpose: tries to read the orchestrator's secrets and reach the network.

It reports what it could see. In a PandaStack sandbox every probe should fail;
the orchestrator checks the report and treats any success as a breach.
"""

import json
import os
import socket

SECRET_MARKERS = (b"PANDASTACK", b"AIRFLOW", b"PREFECT", b"pds_")
probes = {}
probes["env_has_secrets"] = any(m.decode() in k + v for k, v in os.environ.items() for m in SECRET_MARKERS)
for path in ("/root/airflow", "/root/.prefect", "/etc/shadow"):
    try:
        probes[f"read:{path}"] = bool(os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(64))
    except OSError:
        probes[f"read:{path}"] = False
# Every process's environment this job can see: any orchestrator secret there is a breach.
leaked = False
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        continue
    leaked = leaked or any(m in environ for m in SECRET_MARKERS)
probes["proc_environ_has_secrets"] = leaked
probes["host_processes_visible"] = len([p for p in os.listdir("/proc") if p.isdigit()]) > 50
for port in (8080, 4200, 5432, 6379):
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect(("127.0.0.1", port))
        probes[f"connect:127.0.0.1:{port}"] = True
    except OSError:
        probes[f"connect:127.0.0.1:{port}"] = False
    finally:
        s.close()
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1).close()
    probes["internet"] = True
except OSError:
    probes["internet"] = False
breaches = sorted(k for k, v in probes.items() if v)
json.dump({"tenant": "evil_escape", "breaches": breaches, "probes": probes}, open("/work/result.json", "w"))
# A breach is a permanent failure of this tenant's code: exit 3 (configured as permanent).
raise SystemExit(3 if breaches else 0)
