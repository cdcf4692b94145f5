"""The unit state file's layout and headers: where each unit's record sits, what its arrays are,
and how the file header and a record header are packed and checked.

A unit's *layout* is the list of its record's arrays, each a (dtype, count) pair: a unit given as
a plain numel has three fp32 arrays of numel values (an fp32 master and two fp32 moments), and a
compact optimizer state declares others (8-bit moments and their fp32 block scales, a bf16
master: `disk_record.StateRecord`). Every array starts on a 4096-byte boundary of the payload, so
a record's payload is the sum of its arrays' bytes, each rounded up to 4096 (`payload_bytes`).

The file header (rounded up to 4096) holds the magic, the version, the unit count, the file id,
each unit's layout and a CRC-32 of all of it. A record header (4096 bytes) holds the file id, the
unit, the slot, the generation and a key of the unit's layout (its payload bytes and a CRC-32 of
the layout), with a CRC-32 of them: a record of another layout never reads as valid.
"""
from __future__ import annotations

import struct
import zlib
from typing import Sequence

import torch

from .buffers import ALIGN, round_up

__all__ = ["Layout", "unit_layout", "array_offsets", "payload_bytes", "record_layout", "pack_file_header",
           "parse_file_header", "pack_record", "parse_record", "FILE_HEAD_BYTES", "HEADER_BYTES", "VERSION"]

Layout = tuple[tuple[torch.dtype, int], ...]

_FILE_MAGIC, _RECORD_MAGIC, VERSION = b"SLIDEUS2", b"SLIDREC2", 2
_FILE_HEAD = struct.Struct("<8sIIQQ")            # magic, version, unit count, file id, bytes of the layouts
_ARRAY = struct.Struct("<IQ")                    # dtype code, count
_RECORD = struct.Struct("<8sQIIQQ")              # magic, file id, unit, slot, generation, layout key
_CRC = struct.Struct("<I")
FILE_HEAD_BYTES = _FILE_HEAD.size
HEADER_BYTES = ALIGN                             # one record header
_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.uint8: 3, torch.float16: 4, torch.int8: 5}
_DTYPES = {c: d for d, c in _CODES.items()}


def unit_layout(unit) -> Layout:
    """A unit's layout: a numel (three fp32 arrays of it) or (dtype, count) pairs."""
    if isinstance(unit, int):
        if unit < 0:
            raise ValueError("a unit's numel cannot be negative")
        return ((torch.float32, unit),) * 3
    out = tuple((d, int(n)) for d, n in unit)
    for dtype, count in out:
        if dtype not in _CODES or count < 0:
            raise ValueError(f"a record array is one of {sorted(map(str, _CODES))} with a count >= 0, "
                             f"not ({dtype}, {count})")
    return out


def array_offsets(layout: Layout) -> list[int]:
    """Each array's byte offset inside the payload (each a multiple of 4096)."""
    out, pos = [], 0
    for dtype, count in layout:
        out.append(pos)
        pos += round_up(dtype.itemsize * count)
    return out


def payload_bytes(layout: Layout) -> int:
    """Bytes of a record's payload: its arrays, each rounded up to 4096."""
    return sum(round_up(d.itemsize * n) for d, n in layout)


def _layouts_body(layouts: Sequence[Layout]) -> bytes:
    out = b""
    for lay in layouts:
        out += struct.pack("<I", len(lay)) + b"".join(_ARRAY.pack(_CODES[d], n) for d, n in lay)
    return out


def record_layout(units: Sequence, slots: int = 2) -> tuple[int, list[int], list[int]]:
    """(file header bytes, each unit's offset, each unit's slot bytes) for these units (numels or
    layouts), with `slots` slots per unit (2 in a kept file, 1 otherwise)."""
    if slots not in (1, 2):
        raise ValueError(f"a unit has one or two slots, not {slots}")
    layouts = [unit_layout(u) for u in units]
    head = round_up(_FILE_HEAD.size + len(_layouts_body(layouts)) + _CRC.size)
    offsets, sizes, pos = [], [], head
    for lay in layouts:
        size = HEADER_BYTES + payload_bytes(lay)
        offsets.append(pos)
        sizes.append(size)
        pos += slots * size
    return head, offsets, sizes


def pack_file_header(file_id: int, layouts: Sequence[Layout]) -> bytes:
    """The file header's bytes (before its rounding up to 4096)."""
    body = _layouts_body(layouts)
    head = _FILE_HEAD.pack(_FILE_MAGIC, VERSION, len(layouts), file_id, len(body)) + body
    return head + _CRC.pack(zlib.crc32(head))


def parse_file_header(handle, path: str, error) -> tuple[int, list[Layout]]:
    """(file id, layouts) of the file header read from the binary file object `handle`; raises
    `error(message)` when it is not a valid header of this version."""
    head = handle.read(_FILE_HEAD.size)
    if len(head) < _FILE_HEAD.size:
        raise error(f"{path} is not a unit state file (too short)")
    magic, version, count, file_id, nbody = _FILE_HEAD.unpack(head)
    if magic != _FILE_MAGIC or version != VERSION:
        raise error(f"{path} is not a unit state file of version {VERSION}")
    body = handle.read(nbody)
    crc = handle.read(_CRC.size)
    if len(body) != nbody or len(crc) != _CRC.size or zlib.crc32(head + body) != _CRC.unpack(crc)[0]:
        raise error(f"{path}: its file header is damaged (CRC mismatch)")
    layouts, pos = [], 0
    for _ in range(count):
        (num_arrays,), pos = struct.unpack_from("<I", body, pos), pos + 4
        arrays = []
        for _ in range(num_arrays):
            code, numel = _ARRAY.unpack_from(body, pos)
            pos += _ARRAY.size
            arrays.append((_DTYPES[code], numel))
        layouts.append(tuple(arrays))
    return file_id, layouts


def _layout_key(layout: Layout) -> int:
    return (payload_bytes(layout) << 32) ^ zlib.crc32(_layouts_body([layout]))


def pack_record(file_id: int, unit: int, slot: int, generation: int, layout: Layout) -> bytes:
    """A record header's bytes (before its padding to `HEADER_BYTES`)."""
    body = _RECORD.pack(_RECORD_MAGIC, file_id, unit, slot, generation, _layout_key(layout) & (2 ** 64 - 1))
    return body + _CRC.pack(zlib.crc32(body))


def parse_record(raw: bytes, file_id: int, unit: int, slot: int, layout: Layout) -> int:
    """The generation a record header names, or 0 when it is not a valid header of this slot."""
    body, (crc,) = raw[:_RECORD.size], _CRC.unpack_from(raw, _RECORD.size)
    if zlib.crc32(body) != crc:
        return 0
    magic, fid, saved_unit, saved_slot, gen, key = _RECORD.unpack(body)
    want = (_RECORD_MAGIC, file_id, unit, slot, _layout_key(layout) & (2 ** 64 - 1))
    if (magic, fid, saved_unit, saved_slot, key) != want:
        return 0
    return gen
