import sys

from m3lm.cli import main

sys.exit(main())
