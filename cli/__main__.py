"""`python -m whistle_stream.cli ...`: the `whistle-stream` command."""

import sys

from whistle_stream.cli import main

sys.exit(main())
