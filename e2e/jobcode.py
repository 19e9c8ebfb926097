"""The e2e-only job that runs inside the sandbox: sleep, then write a result (shared by DAGs and flows)."""

SLOW_JOB = """\
import json, os, time
inp = json.load(open("/work/input.json"))
print("e2e job started", flush=True)
time.sleep(float(inp["seconds"]))
with open(os.environ.get("JOB_RESULT", "/work/result.json"), "w") as f:
    json.dump({"value": inp["value"] * 2, "slept": inp["seconds"]}, f)
print("e2e job done", flush=True)
"""
