"""python -m kvfs.cli: the `kvfs` command."""
import sys

from .main import main

sys.exit(main())
