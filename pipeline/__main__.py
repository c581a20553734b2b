"""`python -m pipeline`: the command line."""
import sys

from pipeline.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
