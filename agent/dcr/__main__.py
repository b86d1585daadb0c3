import sys

from dcr.cli import main

sys.exit(main())
