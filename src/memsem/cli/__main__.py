import sys

from memsem.cli import main

sys.exit(main())
