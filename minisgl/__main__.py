"""`python -m minisgl [flags]`: the same as `./serve [flags]`."""

import sys

from minisgl.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
