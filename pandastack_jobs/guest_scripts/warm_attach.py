"""The job's side of a warm start: hand this process's job to the standby's warm runner, or run it cold.

Run as ``python3 -I -S warm_attach.py ARGV...`` (stdlib only, Python >= 3.9; it must never import
pandastack_jobs), where ARGV is the job's cold argv (``python3 -m MODULE ARGS``). It connects to
``runner.sock`` beside it and sends {argv, env, cwd} (length-prefixed JSON) with its fds 0, 1, 2;
the runner's child runs the job on them and the runner sends back its exit code, which this
process exits with. SIGTERM/SIGINT/SIGHUP are passed on to the job's process group, so the
guest-side timeout's TERM reaches the job, and what is left of that group is KILLed after the
grace (after a TERM this process exits only once the group is empty or KILLed, even when the
runner already reported the job's exit); if this process is killed outright the runner kills
the job. When there is no runner (gone, refused, says ``cold``), this process execs ARGV
itself: the job still runs, cold, in the same sandbox.
"""

import json
import os
import signal
import socket
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOCK = os.path.join(HERE, "runner.sock")
MAGIC = b"PSW1"
HEADER = struct.Struct("!4sI")
MAX_REPLY_BYTES = 64 * 1024
# The guest clock's grace between TERM and KILL (pandastack_jobs.guest.KILL_GRACE_SECONDS). The shell
# that ``timeout`` runs dies at the TERM, so ``timeout`` never sends its KILL: attach does.
KILL_GRACE_SECONDS = 5
LOST_EXIT_CODE = 70  # EX_SOFTWARE: the runner died after the job started; its end is unknown


def _cold(argv):
    try:
        os.execvp(argv[0], argv)  # noqa: S606 - the cold argv, as the job's command would run it
    except OSError as exc:
        sys.stderr.write(f"{argv[0]}: {exc.strerror or exc}\n")
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def _replies(conn):
    """Each newline-ended JSON reply of the runner, until it hangs up (bounded in total)."""
    buf = b""
    total = 0
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line.decode("utf-8"))
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return
        total += len(chunk)
        if total > MAX_REPLY_BYTES:
            return
        buf += chunk


def _drain(pgid, kill_at):
    """Wait, after a TERM, until nothing is left of the job's process group, KILLing it at ``kill_at``.

    The runner reports the job's exit when its main process dies at the TERM; a child deaf to
    the TERM would outlive the clock, as in the cold path (pandastack_jobs.guest.timed_command).
    Nothing is waited for when nothing survived.
    """
    while True:
        try:
            os.killpg(pgid, 0)
        except OSError:
            return
        if time.monotonic() >= kill_at:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
            return
        time.sleep(0.1)


def main(argv):
    if not argv:
        sys.stderr.write("usage: warm_attach.py ARGV...\n")
        return 2
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(SOCK)
    except OSError:
        _cold(argv)
    payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(conn, [HEADER.pack(MAGIC, len(payload))], [0, 1, 2])
        conn.sendall(payload)
    except OSError:
        conn.close()
        _cold(argv)
    job = []  # type: list[int]
    termed = []  # type: list[float]  # when a TERM was passed on: the job is being timed out

    def forward(signum, _frame):
        if not job:
            os._exit(128 + signum)
        try:
            os.killpg(job[0], signum)
        except OSError:
            pass
        if signum == signal.SIGTERM and not termed:
            termed.append(time.monotonic())
            signal.alarm(KILL_GRACE_SECONDS)  # as ``timeout -k``: a job deaf to TERM is killed

    def kill(_signum, _frame):
        try:
            os.killpg(job[0], signal.SIGKILL)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    signal.signal(signal.SIGALRM, kill)
    try:
        for reply in _replies(conn):
            if "started" in reply:
                job.append(int(reply["started"]))
            elif "exit" in reply:
                if termed:
                    _drain(job[0], termed[0] + KILL_GRACE_SECONDS)
                return int(reply["exit"])
            elif ("cold" in reply or "error" in reply) and not job:
                break  # the runner will not run it (or could not read it): the job never ran
    except (OSError, ValueError):
        pass
    if not job:
        conn.close()
        _cold(argv)  # the runner went away before it forked: the job never ran
    sys.stderr.write("warm runner went away while the job ran; its exit status is unknown\n")
    return LOST_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
