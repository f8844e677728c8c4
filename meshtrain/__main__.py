"""`python -m meshtrain ...` is the `meshtrain` command (also under torchrun: `torchrun ... -m
meshtrain train`)."""

import sys

from meshtrain.services.cli import main

if __name__ == "__main__":
    sys.exit(main())
