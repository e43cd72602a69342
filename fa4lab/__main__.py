import sys

from fa4lab.cli import main

sys.exit(main())
