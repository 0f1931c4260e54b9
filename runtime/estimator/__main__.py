"""``python -m runtime.estimator``: the same command line as the ``ds_estimate`` console script."""

import sys

from runtime.estimator.cli import main

if __name__ == "__main__":  # not when a tool walks the package and imports this module
    sys.exit(main())
