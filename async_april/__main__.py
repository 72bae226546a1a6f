import sys

from async_april.cli import main

sys.exit(main())
