"""torch.save files (``.pt``, ``.pth``, ``.bin``): loaded with ``torch.load(weights_only=True,
mmap=True)`` and flattened to dotted names the way DCP flattens a state dict
(``optim.param_groups.0.lr``).

This is the one reader that imports torch; it does so only when called.

>>> flatten({"a": {"b": 1, "c": [2, 3], "d": [{"e": 4}]}})
{'a.b': 1, 'a.c': [2, 3], 'a.d.0.e': 4}
"""
from __future__ import annotations

import os
import tempfile

from ..errors import FormatError, UnsafeInputError
from ..model import DTYPES, Checkpoint, Chunk, Extent, ObjectEntry, TensorEntry
from ..storage import Store

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
INDEX_SUFFIX = ".bin.index.json"


def is_torch_file(name: str) -> bool:
    return name.endswith(SUFFIXES) and "/" not in name


def _container_or_tensor(v) -> bool:
    return isinstance(v, (dict, list, tuple)) or (hasattr(v, "dtype") and hasattr(v, "shape"))


def flatten_paths(obj, path: tuple = ()) -> dict[str, tuple]:
    """Flattened name -> path of keys/indices in the nested object (DCP's planner_data)."""
    out: dict[str, tuple] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            out.update(flatten_paths(v, path + (k,)))
    elif isinstance(obj, (list, tuple)) and obj and any(_container_or_tensor(v) for v in obj):
        for i, v in enumerate(obj):
            out.update(flatten_paths(v, path + (i,)))
    else:
        out[".".join(str(p) for p in path)] = path
    return out


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Flatten nested dicts to dotted keys, as DCP does. Lists and tuples are descended
    into when they hold tensors or containers (DCP would pickle those whole); lists of
    plain values stay one entry, as in DCP (``optim.param_groups.0.params``)."""
    out: dict[str, object] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and obj and any(_container_or_tensor(v) for v in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def load_torch_file(store: Store, rel: str):
    """``torch.load`` a file safely (weights only, memory-mapped when local)."""
    import pickle

    import torch

    where = store.display(rel)
    path = store.local_path(rel)
    tmp = None
    try:
        if path is None:  # remote: torch needs a seekable local file to mmap
            fd, tmp = tempfile.mkstemp(prefix="ckptctl-", suffix=".pt")
            with os.fdopen(fd, "wb") as out, store.open(rel) as src:
                while block := src.read(8 << 20):
                    out.write(block)
            path = tmp
        try:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "refused"
            if "Unsupported global" in str(e) or "not an allowed global" in str(e) or "GLOBAL" in str(e):
                raise UnsafeInputError(where, "refused: the pickle needs globals that "
                                       "weights_only loading does not allow") from None
            raise FormatError(where, f"not a loadable torch.save file ({first[:120]})") from None
        except (RuntimeError, EOFError, ValueError, OSError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FormatError(where, f"not a loadable torch.save file ({first[:120]})") from None
    finally:
        if tmp:
            os.unlink(tmp)


def read_torch(store: Store, files: dict[str, int], only_file: str | None = None) -> Checkpoint:
    """Read torch.save files into the logical model; tensors stay memory-mapped."""
    import torch

    names = [only_file] if only_file else [f for f in files if is_torch_file(f)]
    ck = Checkpoint(root=store.display(only_file) if only_file else store.url,
                    format="torch", store=store,
                    files={f: files[f] for f in names} if only_file else dict(files))
    loaded = {}
    for rel in names:
        obj = load_torch_file(store, rel)
        loaded[rel] = obj
        for name, value in flatten(obj).items():
            if name in ck.tensors or name in ck.objects:
                raise FormatError(store.display(rel), f"{name}: also stored in another file")
            ext = Extent(rel, 0, files[rel], "torch_save")
            if isinstance(value, torch.Tensor):
                dtype = DTYPES.get(str(value.dtype).removeprefix("torch."))
                if dtype is None:
                    raise FormatError(store.display(rel), f"{name}: unsupported dtype {value.dtype}")
                shape = tuple(value.shape)
                ck.tensors[name] = TensorEntry(name, dtype, shape,
                                               [Chunk((0,) * len(shape), shape, ext)])
            else:
                ck.objects[name] = ObjectEntry(name, ext, value=value,
                                               type_name=type(value).__name__)
    ck.info["loaded"] = {rel: flatten(obj) for rel, obj in loaded.items()}
    ck.info["paths"] = {k: v for obj in loaded.values() for k, v in flatten_paths(obj).items()}
    return ck


def tensor_bytes(ck: Checkpoint, name: str) -> memoryview:
    """Row-major bytes of a tensor of a torch.save checkpoint."""
    import torch

    t = ck.tensors[name]
    value = ck.info["loaded"][t.chunks[0].extent.file][name].contiguous()
    if value.numel() == 0:
        return memoryview(b"")
    return memoryview(value.view(-1).view(torch.uint8).numpy())
