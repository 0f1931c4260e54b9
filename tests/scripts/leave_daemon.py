"""Launcher test worker: starts a process that leaves the job's process groups, writes its pid to
PID_DIR/<rank>, then exits (FAIL_RANK with 3, the others with 0; with STAY=1 the others sleep until stopped).

HOW picks the escape: ``setsid`` (a ``setsid sleep`` child, still the worker's child), ``double_fork``
(a grandchild in its own session whose parent exited at once, so init would have adopted it). The
daemon's command line carries this script's path, so a test can find it on any host."""

import os
import subprocess
import sys
import time

rank = os.environ["RANK"]
how = os.environ.get("HOW", "setsid")
pid_file = os.path.join(os.environ["PID_DIR"], rank)
sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", __file__]
if how == "setsid":
    pid = subprocess.Popen(sleeper, start_new_session=True, stdin=subprocess.DEVNULL).pid
else:
    r, w = os.pipe()
    if os.fork() == 0:  # the middle process: start the daemon in its own session, tell its pid, leave
        os.close(r)
        pid = subprocess.Popen(sleeper, start_new_session=True, stdin=subprocess.DEVNULL).pid
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 64))
    os.wait()
with open(pid_file + ".tmp", "w") as f:
    f.write(str(pid))
os.rename(pid_file + ".tmp", pid_file)
print(f"rank {rank} started daemon {pid}", flush=True)
if rank == os.environ.get("FAIL_RANK"):
    while len(os.listdir(os.environ["PID_DIR"])) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)
    sys.exit(3)
if os.environ.get("STAY") == "1":
    time.sleep(300)
