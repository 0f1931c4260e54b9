"""Launcher test worker for the grace period: rank 1 exits 7 once rank 0 is ready; rank 0 cleans up on
SIGTERM for CLEANUP_S seconds (a flush, an emergency save), then writes SAVED_FILE and exits 0."""

import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
ready = os.path.join(os.environ["READY_DIR"], "rank0.ready")
if rank == 0:

    def on_term(_signum: int, _frame: object) -> None:
        time.sleep(float(os.environ.get("CLEANUP_S", "1.5")))
        with open(os.environ["SAVED_FILE"], "w") as f:
            f.write("saved\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(ready, "w").close()
    print("rank 0 ready", flush=True)
    while True:
        time.sleep(1)
deadline = time.monotonic() + 60
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.02)
print("rank 1 is failing now", flush=True)
sys.exit(7)
