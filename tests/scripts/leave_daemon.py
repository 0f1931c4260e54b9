"""Launcher test worker: starts a process that leaves the job's process groups, waits until that process
wrote its pid to PID_DIR/<rank>, then exits (FAIL_RANK with 3, once every rank's daemon runs; the others
with 0, or with STAY=1 they sleep until stopped).

HOW picks the escape: ``setsid`` (a child in its own session, still the worker's child), ``double_fork``
(a grandchild in its own session whose parent exited at once, so init would have adopted it). With
STUBBORN=1 the daemon ignores SIGTERM. Its command line carries this script's path, so a test can find it
on any host."""

import os
import subprocess
import sys
import time

rank = os.environ["RANK"]
pid_dir = os.environ["PID_DIR"]
how = os.environ.get("HOW", "setsid")
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if os.environ.get("STUBBORN") == "1" else "None"
daemon = f"""
import os, signal, sys, time
{ignore}
path = os.path.join({pid_dir!r}, {rank!r})
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(1000)
"""
sleeper = [sys.executable, "-c", daemon, __file__]
if how == "setsid":
    subprocess.Popen(sleeper, start_new_session=True, stdin=subprocess.DEVNULL)
elif os.fork() == 0:  # the middle process: start the daemon in its own session and leave at once
    subprocess.Popen(sleeper, start_new_session=True, stdin=subprocess.DEVNULL)
    os._exit(0)
else:
    os.wait()
while not os.path.exists(os.path.join(pid_dir, rank)):
    time.sleep(0.01)
print(f"rank {rank} started its daemon", flush=True)
if rank == os.environ.get("FAIL_RANK"):
    while len([f for f in os.listdir(pid_dir) if not f.endswith(".tmp")]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)
    sys.exit(3)
if os.environ.get("STAY") == "1":
    time.sleep(300)
