"""``deepspeed.launcher``: the ``deepspeed`` command (launcher.deepspeed_cli)."""
