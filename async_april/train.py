"""`python -m async_april.train CONFIG [k=v ...]`: the same as `async-april train` (one error path).

An entry point of the launch layer kept at its old name: the controller loop itself is
async_april/launch/controller.py.
"""

import sys

from async_april.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
