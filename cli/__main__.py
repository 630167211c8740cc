"""``python -m sluicegate``: the same command line as the ``sluicegate`` script (:mod:`sluicegate.stack.cli`), for
machines where pip's script folder is not on ``PATH``. Like the stack, this module is a composition root."""

import sys

from sluicegate.stack.cli import main

sys.exit(main())
