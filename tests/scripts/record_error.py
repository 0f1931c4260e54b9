"""Launcher test worker: every rank raises the same ValueError inside a function decorated with torch's
``@record``, which reports through TORCHELASTIC_ERROR_FILE. The ranks wait for each other first (and
ignore SIGTERM), so each fails by itself."""

import os
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import record

signal.signal(signal.SIGTERM, signal.SIG_IGN)


@record
def main() -> None:
    barrier = os.environ["BARRIER_DIR"]
    open(os.path.join(barrier, os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    raise ValueError("shard 3 of data/train.bin is corrupt")


main()
