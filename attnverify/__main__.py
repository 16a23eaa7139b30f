"""`python -m attnverify ...`: the `attnverify` command where its script is not on PATH (a checkout used through
PYTHONPATH, a machine without the package installed). Importing this module runs nothing."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
