"""The runtime's logger ("runtime") and its default handler: a leaf module that every part may import.

`ensure_handler` shows INFO reports when the application configured no logging at all (DeepSpeed's logger
does the same), so `steps_per_print` lines and `see_memory_usage` appear without any set-up, while an
application that configured logging keeps full control.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("runtime")


def ensure_handler() -> None:
    """Give the runtime's logger a stdout handler at INFO unless the application configured logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
