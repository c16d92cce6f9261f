"""`python -m omnivox.services.cli` is the `omnivox` command."""

import sys

from omnivox.services.cli import main

sys.exit(main())
