"""``python bench/memory_model [--validate]``: the memory model's command line (memory_model/report.py)."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a directory: bench/ is the import root of the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory_model.report import main

if __name__ == "__main__":
    sys.exit(main())
