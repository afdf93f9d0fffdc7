"""``python -m storm_compile.cli``: the ``storm`` command."""

import sys

from storm_compile.cli import main

sys.exit(main())
