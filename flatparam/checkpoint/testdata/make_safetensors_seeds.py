#!/usr/bin/env python3
"""Writes the safetensors seed corpus and golden files under testdata/.

Run from this directory: python3 make_safetensors_seeds.py

Everything is built by hand from the format's specification with json and
struct only (no safetensors package), so the C++ reader is checked against an
independent writer. Files named valid_* are well-formed; every other seed is
malformed in the one way its name says. safetensors_test.cc expects a
specific error for each.
"""

import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def header_bytes(header, pad=True):
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return text


def container(header_text, data):
    return struct.pack("<Q", len(header_text)) + header_text + data


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def write(directory, name, contents):
    with open(os.path.join(HERE, directory, name), "wb") as f:
        f.write(contents)


def seeds():
    out = {}
    small_data = f32(0, 1, 2, 3, 4, 5) + struct.pack("<2H", 0x3F80, 0x4000)
    small = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [24, 28]},
    }
    out["valid_small"] = container(header_bytes(small), small_data)
    out["valid_empty"] = container(header_bytes({}), b"")

    # Every supported dtype, a 0-d tensor and a zero-size one, listed in the
    # header out of data order (readers must go by offsets).
    entries = [
        ("f64", "F64", [2], struct.pack("<2d", 1.5, -2.25)),
        ("f32", "F32", [], f32(7.0)),
        ("f16", "F16", [1], struct.pack("<e", 0.5)),
        ("bf16", "BF16", [1], struct.pack("<H", 0xBF80)),
        ("i64", "I64", [1], struct.pack("<q", -3)),
        ("i32", "I32", [1], struct.pack("<i", 9)),
        ("i16", "I16", [1], struct.pack("<h", -7)),
        ("i8", "I8", [2], struct.pack("<2b", -1, 1)),
        ("u8", "U8", [1], struct.pack("<B", 200)),
        ("bool", "BOOL", [2], b"\x01\x00"),
        ("empty", "F32", [0, 4], b""),
    ]
    header, data = {}, b""
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header = dict(reversed(list(header.items())))
    out["valid_all_dtypes"] = container(header_bytes(header), data)

    valid = out["valid_small"]
    out["truncated"] = valid[:-4]
    out["too_short"] = valid[:5]
    out["length_past_end"] = struct.pack("<Q", 10**6) + valid[8:]
    out["length_too_large"] = struct.pack("<Q", 1 << 40) + valid[8:]
    out["bad_json"] = container(b'{"w": {"dtype": "F32",   ', b"")
    out["not_object"] = container(b"[1, 2]  ", b"")
    out["no_brace"] = container(b' {}     ', b"")

    def one(entry, data):
        return container(header_bytes({"t": entry}), data)

    out["offsets_out_of_range"] = one(
        {"dtype": "F32", "shape": [250], "data_offsets": [0, 1000]}, f32(1, 2))
    out["offsets_reversed"] = one(
        {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}, f32(1, 2))
    out["overlapping"] = container(header_bytes({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }), f32(1, 2, 3))
    out["gap"] = container(header_bytes({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }), f32(1, 2, 3, 4, 5))
    out["trailing_bytes"] = one(
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, f32(1, 2))
    out["wrong_dtype_size"] = one(
        {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, f32(1, 2))
    out["unknown_dtype"] = one(
        {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}, b"\x00")
    out["huge_shape"] = one(
        {"dtype": "F32", "shape": [1 << 32, 1 << 32, 1 << 32],
         "data_offsets": [0, 4]}, f32(1))
    out["negative_shape"] = one(
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, f32(1))
    out["missing_offsets"] = one({"dtype": "F32", "shape": [1]}, f32(1))
    out["unknown_key"] = one(
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}, f32(1))
    out["metadata_not_string"] = container(
        header_bytes({"__metadata__": {"epoch": 3}}), b"")
    dup = (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
           b'"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}')
    out["duplicate_key"] = container(dup + b" " * ((8 - len(dup) % 8) % 8),
                                     f32(1))
    return out


def goldens():
    """Bytes copied from the reference implementation's own tests
    (safetensors/src/tensor.rs: test_serialization_forced_alignement and
    test_empty), rebuilt here field by field to show how they arise."""
    attn0_header = (b'{"attn0":{"dtype":"F32","shape":[1,1,2,3],'
                    b'"data_offsets":[0,24]}}')
    assert len(attn0_header) == 65
    attn0 = container(attn0_header + b" " * 7, f32(0, 1, 2, 3, 4, 5))
    reference = bytes([
        72, 0, 0, 0, 0, 0, 0, 0, 123, 34, 97, 116, 116, 110, 48, 34, 58, 123,
        34, 100, 116, 121, 112, 101, 34, 58, 34, 70, 51, 50, 34, 44, 34, 115,
        104, 97, 112, 101, 34, 58, 91, 49, 44, 49, 44, 50, 44, 51, 93, 44, 34,
        100, 97, 116, 97, 95, 111, 102, 102, 115, 101, 116, 115, 34, 58, 91,
        48, 44, 50, 52, 93, 125, 125, 32, 32, 32, 32, 32, 32, 32, 0, 0, 0, 0,
        0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64
    ])
    assert attn0 == reference
    meta = container(b'{"__metadata__":{"framework":"pt"}}' + b" " * 5, b"")
    assert meta == bytes([
        40, 0, 0, 0, 0, 0, 0, 0, 123, 34, 95, 95, 109, 101, 116, 97, 100, 97,
        116, 97, 95, 95, 34, 58, 123, 34, 102, 114, 97, 109, 101, 119, 111,
        114, 107, 34, 58, 34, 112, 116, 34, 125, 125, 32, 32, 32, 32, 32
    ])
    empty = container(b"{}" + b" " * 6, b"")
    assert empty == bytes([8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32,
                           32, 32])
    return {"attn0": attn0, "metadata_only": meta, "empty": empty}


if __name__ == "__main__":
    for name, contents in seeds().items():
        write("safetensors", name + ".safetensors", contents)
    for name, contents in goldens().items():
        write("golden", name + ".safetensors", contents)
