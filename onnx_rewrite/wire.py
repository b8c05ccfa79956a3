"""Protobuf wire format by hand, for the one message too big to serialize in memory.

write.py writes a model with big initializers as its serialized head followed by one
`graph { initializer { ... } }` field per big initializer, whose raw data it streams: protobuf's
parsers merge repeated occurrences of an embedded message.
"""
from __future__ import annotations

_RAW_DATA_FIELD = 9  # TensorProto.raw_data
_INITIALIZER_FIELD = 5  # GraphProto.initializer
_GRAPH_FIELD = 7  # ModelProto.graph


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field."""
    return _varint(number << 3 | 2) + _varint(length)


def initializer_head(meta: bytes, length: int) -> bytes:
    """The bytes of `graph { initializer { <meta> raw_data: <length bytes> } }` up to the raw
    data itself, which the caller writes next. `meta` is the serialized TensorProto without
    its raw_data."""
    tensor_len = len(meta) + len(_len_field(_RAW_DATA_FIELD, length)) + length
    init = _len_field(_INITIALIZER_FIELD, tensor_len)
    return _len_field(_GRAPH_FIELD, len(init) + tensor_len) + init + meta + _len_field(_RAW_DATA_FIELD, length)


def copy_fields(src, dst, skip: set[str]) -> None:
    """Copy every set field of message `src` into `dst`, but those named in `skip` (never read:
    reading a tensor's raw_data copies its bytes, which ListFields would do)."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name in skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED  # (protobuf < 6)
        if repeated:
            getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif src.HasField(fd.name):
            value = getattr(src, fd.name)
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(value)
            else:
                setattr(dst, fd.name, value)
