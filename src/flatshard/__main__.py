"""``python -m flatshard``: the ``flatshard`` command (see ``flatshard/cli.py``)."""

import sys

from flatshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
