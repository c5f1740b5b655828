"""`python -m service` = `whistle-stream serve`."""

import sys

from .server import main

sys.exit(main())
