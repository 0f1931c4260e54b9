"""Launcher test worker: writes <dir>/<rank>.pid, then the rank named by FAIL_RANK fails as FAIL_HOW
says ("exit:7" or "sigkill") after FAIL_AFTER seconds; every other rank sleeps (and leaves a sleeping
child in its process group, which must not survive the job either). With IGNORE_TERM set, the ranks
ignore SIGTERM, as a worker stuck in a collective or a careless signal handler would."""

import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid_dir = os.environ["PID_DIR"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
print(f"rank {rank} ready", flush=True)
if str(rank) == os.environ.get("FAIL_RANK"):
    time.sleep(float(os.environ.get("FAIL_AFTER", "1")))
    print(f"rank {rank} is failing now", flush=True)
    how = os.environ.get("FAIL_HOW", "exit:7")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how.split(":")[1]))
time.sleep(300)
