"""Writes the torch.save files of torch_save_test (run with Debian's
python3-torch 1.13: /usr/bin/python3 make_torch_files.py).

tiny_state_dict.pt  Sequential(Linear(3, 4), LayerNorm(4), Linear(4, 2)),
                    every parameter arange(numel) / 8 + 100 * index
tiny_adamw.pt       AdamW(lr=1e-3) after one step on it
views.pt            a transposed view and an offset view of one storage,
                    and an expanded (stride 0) one
huge_view.pt        a 64 GiB expanded view of one element (refused)
dtypes.pt           one tensor of each storage type flatparam reads
evil_os_system.pt   a pickle that would call os.system (refused)
custom_class.pt     a pickled instance of a user's class (refused)
legacy_format.pt    _use_new_zipfile_serialization=False (refused)
deflated.pt         tiny_state_dict.pt with its first storage deflated
                    (as Python's zipfile may write it; read)
deflate_bomb.pt     the same with 64 MiB of zeros deflated to about 64 KiB
                    where the storage's 48 bytes belong (refused unread,
                    without inflating it)
"""
import collections
import os
import zipfile

import torch


def tiny_model():
    m = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / 8
                    + 100 * i)
    return m


class Evil:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


class Custom:
    pass


def rezip(src, dst, member, data):
    """Copies the zip `src` to `dst`, every record stored as it was except
    `member`, deflated, with `data` (its own bytes when None)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            raw = zin.read(info.filename)
            if info.filename.endswith(member):
                zout.writestr(info.filename, raw if data is None else data,
                              compress_type=zipfile.ZIP_DEFLATED,
                              compresslevel=9)
            else:
                zout.writestr(info.filename, raw,
                              compress_type=zipfile.ZIP_STORED)


def main():
    m = tiny_model()
    torch.save(m.state_dict(), "tiny_state_dict.pt")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), "tiny_adamw.pt")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"t": x.t(), "row": x[1],
                "e": torch.arange(3, dtype=torch.float32).expand(2, 3)},
               "views.pt")
    torch.save({"huge": torch.zeros(1).expand(2**34)}, "huge_view.pt")
    torch.save(collections.OrderedDict(
        f64=torch.tensor([1.5], dtype=torch.float64),
        f16=torch.tensor([1.5], dtype=torch.float16),
        bf16=torch.tensor([1.5], dtype=torch.bfloat16),
        i64=torch.tensor([-3], dtype=torch.int64),
        i32=torch.tensor([-3], dtype=torch.int32),
        u8=torch.tensor([3], dtype=torch.uint8),
        b=torch.tensor([True]),
        scalar=torch.tensor(2.0)), "dtypes.pt")
    torch.save({"a": Evil()}, "evil_os_system.pt")
    torch.save({"a": Custom()}, "custom_class.pt")
    torch.save(m.state_dict(), "legacy_format.pt",
               _use_new_zipfile_serialization=False)
    rezip("tiny_state_dict.pt", "deflated.pt", "/data/0", None)
    rezip("tiny_state_dict.pt", "deflate_bomb.pt", "/data/0",
          bytes(64 << 20))


if __name__ == "__main__":
    main()
