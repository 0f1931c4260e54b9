"""``deepspeed.env_report``: DeepSpeed's report module. ``ds_report`` (this distribution's command and
dslaunch's are the same entry point, ``launcher.report:main``) includes which ``deepspeed`` is importable."""

from launcher.deepspeed_report import DeepSpeedFound, find_deepspeed
from launcher.report import main

__all__ = ["DeepSpeedFound", "find_deepspeed", "main"]

if __name__ == "__main__":
    main()
