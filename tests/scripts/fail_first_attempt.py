"""Launcher test worker: appends its attempt number to <ATTEMPT_DIR>/rank_<R>. On attempt 0, rank 0 waits
until every rank has recorded the attempt, then fails with exit code 3; the others sleep."""

import os
import sys
import time

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["DSLAUNCH_ATTEMPT"])
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
with open(os.path.join(os.environ["ATTEMPT_DIR"], f"rank_{rank}"), "a") as f:
    f.write(f"{attempt}\n")
if attempt == 0:
    if rank == 0:
        files = [os.path.join(os.environ["ATTEMPT_DIR"], f"rank_{r}") for r in range(world)]
        deadline = time.monotonic() + 30
        while not all(os.path.exists(p) for p in files) and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(3)
    time.sleep(300)
print(f"rank {rank} done on attempt {attempt}", flush=True)
