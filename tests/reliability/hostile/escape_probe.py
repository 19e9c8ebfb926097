"""Everything a job can try to see or touch outside its sandbox, reported as its result.

Input (JOB_INPUT): markers to look for in any environment, host words for command lines, paths
to read and write, TCP addresses to connect to, pids to kill, a sibling's secret file token.
"""

import json
import os
import signal
import socket

with open(os.environ["JOB_INPUT"]) as f:
    cfg = json.load(f)
markers = cfg["markers"]
seen = {}


def read(path, size=-1):
    with open(path, "rb") as f:
        return f.read(size)


def write(path):
    with open(path, "w") as f:
        f.write("escaped")


def succeeded(action, *args):
    """Whether ``action(*args)`` got past the sandbox's walls (no OSError)."""
    try:
        action(*args)
    except OSError:
        return False
    return True


# Everything this job can see of anyone's environment.
env_text = "\n".join(f"{k}={v}" for k, v in os.environ.items())
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        env_text += "\n" + read(f"/proc/{pid}/environ").decode(errors="replace")
    except OSError:
        pass
seen["env_text"] = env_text
seen["env_markers"] = [m for m in markers if m in env_text]
pids = [p for p in os.listdir("/proc") if p.isdigit()]
seen["pid_count"] = len(pids)


def own_chain():
    """This probe and the processes that started it (the job's own shell carries the job's input,
    host words and all, in its command line): not someone else's processes."""
    chain, pid = set(), os.getpid()
    while pid > 1:
        chain.add(str(pid))
        pid = int(read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[1])
    return chain


mine = own_chain()
cmdlines = []
for pid in (p for p in pids if p not in mine):
    try:
        cmdlines.append(read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode())
    except OSError:
        pass
seen["host_cmdlines"] = [c for c in cmdlines if any(w in c for w in cfg["host_words"])]
seen["host_env"] = [w for w in cfg["host_words"] + cfg["host_env_words"] if w in env_text]
seen["readable"] = [
    path
    for path in cfg["read_paths"]
    if (succeeded(os.listdir, path) if os.path.isdir(path) else succeeded(read, path, 1))
]
found = []
for top in ("/", "/proc/1/root"):
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/usr", "/dev")]
        found += [os.path.join(root, f) for f in files if cfg["sibling_token"] in f]
for pid in pids:
    try:
        found += [f for f in os.listdir(f"/proc/{pid}/root/work") if cfg["sibling_token"] in f]
    except OSError:
        pass
seen["sibling_files"] = found
connected = []
for host, port in cfg["tcp"]:
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((host, port))
        connected.append(f"{host}:{port}")
    except OSError:
        pass
    finally:
        s.close()
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(1.0)
    query = bytes.fromhex("1234010000010000000000000000010001")  # a DNS query for "."
    u.sendto(query, ("8.8.8.8", 53))
    u.recvfrom(512)
    connected.append("udp:8.8.8.8:53")
except OSError:
    pass
seen["connected"] = connected
seen["written_inside"] = [path for path in cfg["write_paths"] if succeeded(write, path)]
seen["killed"] = [pid for pid in cfg["kill_pids"] if succeeded(os.kill, pid, signal.SIGKILL)]
with open(os.environ["JOB_RESULT"], "w") as f:
    json.dump(seen, f)
