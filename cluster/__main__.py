"""`python -m cluster` is `mscluster`."""

import sys

from cluster.cli import main

sys.exit(main())
