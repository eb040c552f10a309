"""A checkpoint's DCP metadata read under other Pythons (pickled enum members and moved classes)."""
from __future__ import annotations

import sys

import pytest
import torch


def test_metadata_written_by_python_3_11_2_loads_and_its_getattr_reaches_enum_members_only(tmp_path):
    """Python 3.11.0-3.11.4 (Debian 12's, the image's) pickle an enum member as getattr(Enum, "NAME"): a
    checkpoint written in the image must load outside it. That getattr reaches members of the allowed enums,
    never an attribute of anything else (getattr(class, "__init__") would lead to code)."""
    import enum
    import io
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from train.checkpoint.dcp_io import MetadataUnpickler, Reader

    class Py3112Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    metadata = Reader(tmp_path).read_metadata()
    buf = io.BytesIO()
    Py3112Pickler(buf).dump(metadata)
    assert b"getattr" in buf.getvalue()  # the form the image writes
    (tmp_path / ".metadata").write_bytes(buf.getvalue())
    assert Reader(tmp_path).read_metadata().state_dict_metadata.keys() == {"w"}
    into = {"w": torch.zeros(2, 3)}
    dcp.load(into, storage_reader=Reader(tmp_path), no_dist=True)
    assert torch.equal(into["w"], torch.arange(6.0).reshape(2, 3))
    evil = io.BytesIO()
    pickle.Pickler(evil).dump(type("Evil", (), {"__reduce__": lambda self: (getattr, (Metadata, "__init__"))})())
    with pytest.raises(pickle.UnpicklingError, match="no member of DCP's metadata enums"):
        MetadataUnpickler(io.BytesIO(evil.getvalue())).load()


def test_metadata_that_names_a_class_where_another_python_moved_it_loads(tmp_path, monkeypatch):
    """Python 3.13 pickles pathlib.PosixPath as pathlib._local.PosixPath (DCP's .metadata holds the folder's
    path): a checkpoint written on one Python resumes on any other docs/checkpoints.md names. A submodule of an
    allowed module reaches only that module's allowed classes, and is never imported."""
    import io
    import pathlib
    import pickle
    import types

    import torch.distributed.checkpoint as dcp

    from train.checkpoint.dcp_io import MetadataUnpickler, Reader

    moved = type("PosixPath", (), {"__module__": "pathlib._local", "__qualname__": "PosixPath"})
    if "pathlib._local" not in sys.modules:  # before 3.13, make the name resolvable for the pickler
        monkeypatch.setitem(sys.modules, "pathlib._local", types.SimpleNamespace(PosixPath=moved))
    real = sys.modules["pathlib._local"].PosixPath

    class Py313Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return (real, (str(obj),)) if isinstance(obj, pathlib.PurePath) else NotImplemented

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    metadata = Reader(tmp_path).read_metadata()
    metadata.storage_meta.checkpoint_id = pathlib.Path(tmp_path)  # what DCP records
    buf = io.BytesIO()
    Py313Pickler(buf).dump(metadata)
    assert b"pathlib._local" in buf.getvalue()  # the form 3.13 writes
    (tmp_path / ".metadata").write_bytes(buf.getvalue())
    monkeypatch.delitem(sys.modules, "pathlib._local", raising=False)  # as on 3.11: no such module
    into = {"w": torch.zeros(2, 3)}
    dcp.load(into, storage_reader=Reader(tmp_path), no_dist=True)
    assert torch.equal(into["w"], torch.arange(6.0).reshape(2, 3))
    for module, name in (("pathlib._local", "os"), ("pathlib.os", "system"), ("pathlibx", "PosixPath")):
        with pytest.raises(pickle.UnpicklingError, match="none of DCP's metadata classes"):
            MetadataUnpickler(io.BytesIO(pickle.dumps(None).replace(b"N", b"c" + f"{module}\n{name}\n".encode(),
                                                                     1))).load()
