import sys

from m3lm.cli import main

if __name__ == "__main__":  # not when a spawned process (the engine's) imports this module
    sys.exit(main())
