import sys

from fa4lab.fuzz.cli import main

sys.exit(main())
