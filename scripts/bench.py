#!/usr/bin/env python
"""Same as `minedraft bench`: compare target-alone, sequential SD and the two-batch pipeline in one run."""
import sys

from minedraft.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
