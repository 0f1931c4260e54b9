"""``deepspeed.launcher.runner``: ``main`` is the ``deepspeed`` command (launcher.deepspeed_cli), and the
names of DeepSpeed's env file (``K=V`` lines every worker on another host gets; read by launcher.envfwd
beside ``.dslaunch_env``). ``accelerate launch`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` to write into it."""

import os

from launcher.deepspeed_cli import main
from launcher.envfwd import deepspeed_env_file_name

DEEPSPEED_ENVIRONMENT_NAME = deepspeed_env_file_name()
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]  # read in this order; the later file wins

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "main"]

if __name__ == "__main__":
    main()
