"""python -m train.launch [launcher options] -- [training arguments]: see train/launch/launcher.py."""

import gc
import sys

from train.launch.launcher import main

code = main()
# The launcher has imported torch (for the task's config), millions of objects that the interpreter's exit
# would walk in its garbage collections, about a second of CPU after torchrun has ended: left to the OS.
gc.freeze()
sys.exit(code)
