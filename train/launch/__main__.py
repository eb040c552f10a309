"""python -m train.launch [launcher options] -- [training arguments]: see train/launch/launcher.py."""

import gc
import sys

from train.launch.launcher import main

code = main()
# A launcher that has imported torch (a node that waits for its rendezvous host checks the task's config and
# probes the host; --nproc-per-node=auto counts GPUs) holds millions of objects that the interpreter's exit
# would walk in its garbage collections after torchrun has ended: left to the OS.
gc.freeze()
sys.exit(code)
