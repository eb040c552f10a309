"""The built-in GPT, writing the name of each tensor that the trainer gives its random init (Task.init_parameter)
to the file $INIT_LOG, one a line: what a launch draws (tests/processes/test_pretrained.py)."""

import os

from train.tasks.gpt import LanguageModel


class LoggedInit(LanguageModel):
    def init_parameter(self, name, full, generator):
        super().init_parameter(name, full, generator)
        with open(os.environ["INIT_LOG"], "a") as f:
            f.write(f"{name}\n")
