"""``deepspeed.launcher.runner``: ``main`` is the ``deepspeed`` command (launcher.deepspeed_cli)."""

from launcher.deepspeed_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
