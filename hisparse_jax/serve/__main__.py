"""`python3 -m hisparse_jax.serve --model PATH|CONFIG_NAME [...]`: `cli.main`."""

import sys

from hisparse_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
