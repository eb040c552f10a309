"""The built-in GPT, writing the name of each tensor that the trainer gives its random init (Task.init_parameter)
to the file $INIT_LOG, one a line after the rank that drew it (RANK NAME; 0 for one process): what a launch draws
(tests/processes/test_pretrained.py)."""

import os

from train.tasks.gpt import LanguageModel


class LoggedInit(LanguageModel):
    def init_parameter(self, name, full, generator):
        super().init_parameter(name, full, generator)
        with open(os.environ["INIT_LOG"], "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {name}\n")
