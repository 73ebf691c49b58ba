#!/usr/bin/env python3
"""Reads the file safetensors_sample_writer writes, with only json and
struct, following the safetensors specification; exits non-zero with a
message on any difference."""

import json
import struct
import sys


def main(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0, "header length %d is not a multiple of 8" % n
    text = blob[8:8 + n].decode("utf-8")
    assert text.startswith("{"), text[:20]
    header = json.loads(text)
    assert header.pop("__metadata__") == {"writer": "flatparam"}
    data = blob[8 + n:]

    # Offsets tile the data section.
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    end = 0
    for begin, stop in spans:
        assert begin == end, (begin, end)
        end = stop
    assert end == len(data), (end, len(data))

    def raw(name, dtype, shape):
        e = header[name]
        assert e["dtype"] == dtype and e["shape"] == shape, (name, e)
        begin, stop = e["data_offsets"]
        return data[begin:stop]

    def bf16(b):
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0]
                for (h,) in struct.iter_unpack("<H", b)]

    checks = [
        (struct.unpack("<6f", raw("layers.0.w", "F32", [2, 3])),
         (0, 0.5, 1, 1.5, 2, 2.5)),
        (struct.unpack("<d", raw("step", "F64", [])), (3.25,)),
        (struct.unpack("<3e", raw("half", "F16", [3])), (1, -2, 0.5)),
        (tuple(bf16(raw("brain", "BF16", [2]))), (1.5, -4)),
        (raw("empty", "F32", [0, 3]), b""),
        (struct.unpack("<2q", raw("ints", "I64", [2])), (-1, 1 << 40)),
    ]
    for got, want in checks:
        assert tuple(got) == tuple(want) if not isinstance(want, bytes) \
            else got == want, (got, want)
    print("OK: %d tensors read with json + struct" % len(header))


if __name__ == "__main__":
    main(sys.argv[1])
