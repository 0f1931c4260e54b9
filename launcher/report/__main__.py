"""`python -m launcher.report`: the same as the `ds_report` command."""

import sys

from launcher.report import main

sys.exit(main())
