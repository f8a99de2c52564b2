import sys

from pimm.cli import main

sys.exit(main())
