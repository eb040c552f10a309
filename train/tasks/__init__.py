"""The built-in tasks, written against train/task.py exactly as a user's task is: image classification
(the default) and a causal language model. Selected by task.name like any other."""
