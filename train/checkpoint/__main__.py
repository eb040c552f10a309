"""python -m train.checkpoint --convert RUN_DIR: converts the checkpoints of 42fd791 and earlier."""

import sys

from train.checkpoint.convert import main

sys.exit(main())
