"""``python -m sonar_kernels.train``: the same as ``sonar-train``."""

import sys

from sonar_kernels.train.cli import main

sys.exit(main())
