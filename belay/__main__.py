import sys

from belay.cli import main

sys.exit(main())
