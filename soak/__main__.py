from __future__ import annotations

import sys

from soak.driver import main

sys.exit(main())
