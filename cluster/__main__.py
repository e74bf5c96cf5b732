"""`python -m cluster` is `mscluster`."""

import sys

from cluster.tools.cli import main

sys.exit(main())
