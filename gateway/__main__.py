"""Entry point: `python -m gateway serve|status|make-tokens` (see gateway.cli)."""

import sys

from gateway.cli import main

sys.exit(main())
