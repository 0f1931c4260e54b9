"""dslaunch: start one worker per device on one or many machines, and stop them all cleanly.

The launcher never imports torch: it plans ranks, starts node agents and supervises them. Workers learn
their place in the job only from the environment (see ``launcher.plan``).
"""

__version__ = "0.1.0"
