"""python -m train.launch [launcher options] -- [training arguments]: see train/launch/launcher.py."""

import sys

from train.launch.launcher import main

sys.exit(main())
