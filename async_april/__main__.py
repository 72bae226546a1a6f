"""`python -m async_april ...` = `async-april ...` (an entry point of the launch layer)."""

import sys

from async_april.launch.cli import main

sys.exit(main())
