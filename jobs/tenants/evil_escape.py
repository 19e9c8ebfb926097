"""HOSTILE on purpose: tries to read the orchestrator's secrets and reach the network.

It reports what it could see. In a PandaStack sandbox every probe should fail;
the orchestrator checks the report and treats any success as a breach.
"""

import json
import os
import socket

probes = {}
probes["env_has_api_key"] = any("PANDASTACK" in k or "AIRFLOW" in k or "PREFECT" in k for k in os.environ)
for path in ("/root/airflow", "/root/.prefect", "/etc/shadow", "/proc/1/environ"):
    try:
        probes[f"read:{path}"] = bool(os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(64))
    except OSError:
        probes[f"read:{path}"] = False
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
