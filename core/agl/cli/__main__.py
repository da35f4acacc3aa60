"""``python -m agl.cli``: the ``agl`` command, for where the script is not on PATH (runners started by tests)."""

import sys

from agl.cli import main

sys.exit(main())
