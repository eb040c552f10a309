"""task.name -> the task's class: a file of the user's (path/to/file.py:Name) or a module (package.module:Name),
imported so that loader workers import it the same way; every mistake in one line."""

from __future__ import annotations

import importlib
import sys
import traceback
from dataclasses import is_dataclass
from pathlib import Path

from train.errors import ConfigError
from train.task import Task

DEFAULT = "train.tasks.image:ImageClassification"  # task.name unless a config says otherwise
REQUIRED = ("datasets", "model", "loss")


def _import_file(path: Path):
    """A task's file, imported under its own name with its folder first on sys.path: loader workers (which
    the trainer starts from a fork server, with this process's sys.path) then unpickle its data sets'
    classes by importing it the same way."""
    if not path.is_file():
        raise ConfigError(f"task.name: {path} does not exist (relative paths start at {Path.cwd()})")
    folder, name = str(path.resolve().parent), path.stem
    if not name.isidentifier():
        raise ConfigError(f"task.name: {path}: a task file's name must be a Python identifier (rename it)")
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path.resolve():
        raise ConfigError(f"task.name: {path} has the name of the module {name} ({getattr(loaded, '__file__', '')})"
                          f": rename the file")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def load_class(spec: str) -> type[Task]:
    """`path/to/file.py:Name` or `package.module:Name` -> the Task subclass; ConfigError naming what is wrong."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise ConfigError(f"task.name: {spec!r} is not of the form path/to/file.py:ClassName or module:ClassName")
    try:
        if where.endswith(".py"):
            module = _import_file(Path(where))
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # a mistake in the task's file: where it is, in one line
        if isinstance(e, ModuleNotFoundError) and e.name and (where == e.name or where.startswith(e.name + ".")):
            raise ConfigError(f"task.name: cannot import {where} ({e}); install it or give a .py file's path") from None
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" at {frame.filename}:{frame.lineno}" if frame else ""
        raise ConfigError(f"task.name: importing {where} failed{at}: {type(e).__name__}: {e}") from None
    cls = getattr(module, name, None)
    if cls is None:
        have = sorted(k for k, v in vars(module).items()
                      if isinstance(v, type) and issubclass(v, Task) and v is not Task)
        raise ConfigError(f"task.name: {where} has no {name}" + (f" (it has {', '.join(have)})" if have else ""))
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task.name: {spec} is not a subclass of train.task.Task")
    missing = [m for m in REQUIRED if getattr(cls, m) is getattr(Task, m)]
    if missing:
        raise ConfigError(f"task.name: {spec} does not define {', '.join(missing)}()")
    if not is_dataclass(cls.Config):
        raise ConfigError(f"task.name: {spec}.Config is not a @dataclass")
    return cls
