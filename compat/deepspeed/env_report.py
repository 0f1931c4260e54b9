"""``deepspeed.env_report``: ``ds_report`` (launcher.deepspeed_report, then dslaunch's report)."""

from launcher.deepspeed_report import cli_main, main

__all__ = ["cli_main", "main"]

if __name__ == "__main__":
    cli_main()
