import sys

from omnivox.benchmarks.main import main

sys.exit(main())
