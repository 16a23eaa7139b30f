"""`python -m attnverify ...`: the `attnverify` command where its script is not on PATH (a checkout used through
PYTHONPATH, a machine without the package installed)."""
import sys

from .cli import main

sys.exit(main())
