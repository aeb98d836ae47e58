import sys

from megaresil.cli import main

sys.exit(main())
