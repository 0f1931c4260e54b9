"""Launcher test worker: the ranks in FAIL_RANKS leave an error file in torch's format (the one the
runtime and torch's ``@record`` write, plus our kind and hint) and exit with FAIL_CODE; the others sleep.

FAIL_MESSAGE is the message; ``{rank}`` in it becomes the rank, so ranks can fail differently. The failing
ranks wait for each other before exiting (and ignore SIGTERM), so they all fail by themselves, at once."""

import json
import os
import signal
import sys
import time
import traceback

rank = int(os.environ["RANK"])
failing = [int(r) for r in os.environ["FAIL_RANKS"].split(",")]
if rank not in failing:
    print(f"rank {rank} sleeps", flush=True)
    time.sleep(300)
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
message = os.environ["FAIL_MESSAGE"].format(rank=rank)
try:
    raise ValueError(message)
except ValueError:
    stack = traceback.format_exc()
print(f"rank {rank} is failing now", flush=True)
doc = {
    "message": {
        "message": message,
        "extraInfo": {
            "py_callstack": stack,
            "timestamp": str(int(time.time())),
            "kind": os.environ.get("FAIL_KIND", "exception"),
            "hint": os.environ.get("FAIL_HINT", ""),
        },
    }
}
assert os.environ["DSLAUNCH_ERROR_FILE"] == os.environ["TORCHELASTIC_ERROR_FILE"]
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(doc, f)
barrier = os.environ["BARRIER_DIR"]
open(os.path.join(barrier, str(rank)), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(barrier)) < len(failing) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(int(os.environ.get("FAIL_CODE", "2")))
