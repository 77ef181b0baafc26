"""`python -m pyengine ...`: see pyengine/cli.py."""

import sys

from pyengine.cli import main

sys.exit(main())
