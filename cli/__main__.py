"""``python -m cli``: the same command line as the ``sluicegate`` script (:mod:`cli.main`), for machines where the
virtual environment's script folder is not on ``PATH``."""

import sys

from cli.main import main

sys.exit(main())
