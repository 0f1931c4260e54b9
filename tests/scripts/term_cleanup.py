"""Launcher test worker for the grace period: once every other rank is ready, rank FAIL_RANK (default 1)
exits 7; every other rank cleans up on SIGTERM for CLEANUP_S seconds (a flush, an emergency save), then
writes SAVED_DIR/<rank> and exits 0."""

import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
ready_dir = os.environ["READY_DIR"]
if rank != int(os.environ.get("FAIL_RANK", "1")):

    def on_term(_signum: int, _frame: object) -> None:
        time.sleep(float(os.environ.get("CLEANUP_S", "1.5")))
        with open(os.path.join(os.environ["SAVED_DIR"], str(rank)), "w") as f:
            f.write("saved\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(ready_dir, str(rank)), "w").close()
    print(f"rank {rank} ready", flush=True)
    while True:
        time.sleep(1)
others = int(os.environ["WORLD_SIZE"]) - 1
deadline = time.monotonic() + 60
while len(os.listdir(ready_dir)) < others and time.monotonic() < deadline:
    time.sleep(0.02)
print(f"rank {rank} is failing now", flush=True)
sys.exit(7)
