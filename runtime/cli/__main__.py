"""`python -m rljob.runtime.cli`: how `rljob run --nproc N` starts each rank through torchrun."""

import sys

from rljob.runtime.cli.entry import main

sys.exit(main())
