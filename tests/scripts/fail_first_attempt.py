"""Launcher test worker: appends its attempt number to <ATTEMPT_DIR>/rank_<R>; rank 0 fails on attempt 0."""

import os
import sys
import time

rank = int(os.environ["RANK"])
attempt = int(os.environ["DSLAUNCH_ATTEMPT"])
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
with open(os.path.join(os.environ["ATTEMPT_DIR"], f"rank_{rank}"), "a") as f:
    f.write(f"{attempt}\n")
if attempt == 0:
    if rank == 0:
        sys.exit(3)
    time.sleep(300)
print(f"rank {rank} done on attempt {attempt}", flush=True)
