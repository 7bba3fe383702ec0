import sys

from paradit.cli import main

sys.exit(main())
