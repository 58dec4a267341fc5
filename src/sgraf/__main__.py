import sys

from sgraf.cli import main

sys.exit(main())
