import sys

from hostpool.cli import main

sys.exit(main())
