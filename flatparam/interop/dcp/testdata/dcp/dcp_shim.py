# Debian's torch 1.13 on Python 3.11: torch.distributed._shard's
# ShardedTensorMetadata has a dataclass default of TensorProperties(),
# which Python 3.11 refuses as mutable (its class is unhashable). Making
# that one class hashable before the module defines the default lets it
# import; nothing else changes.
import dataclasses
_dataclass = dataclasses.dataclass
def _patched(cls=None, **kw):
    def wrap(c):
        out = _dataclass(**kw)(c)
        if c.__name__ == "TensorProperties" and out.__hash__ is None:
            out.__hash__ = object.__hash__
        return out
    return wrap if cls is None else wrap(cls)
dataclasses.dataclass = _patched
import torch.distributed._shard.checkpoint  # noqa: E402
dataclasses.dataclass = _dataclass
