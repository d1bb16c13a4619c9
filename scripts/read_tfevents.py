#!/usr/bin/python3
"""Independent reader for TensorBoard event files, used by tests/test_tensorboard.cpp.

Checks the TFRecord framing (both masked CRC-32C of every record, computed bit by bit here,
not with polytrain's tables) and decodes each tensorflow.Event. When python3-protobuf is
installed the Event/Summary messages are built from a descriptor with the field numbers of
tensorflow's event.proto/summary.proto and parsed by the protobuf library itself; otherwise a
minimal wire-format decoder below is used. Prints one JSON object per event:
  {"wall_time": ..., "step": ..., "file_version": ...} or {..., "tag": ..., "value": ...}
Usage: read_tfevents.py [--decoder=protobuf|minimal] FILE   (exit 1 on any corruption)
"""
import json
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(blob):
    pos = 0
    while pos < len(blob):
        if len(blob) - pos < 12:
            raise ValueError("truncated record header at byte %d" % pos)
        (length,) = struct.unpack_from("<Q", blob, pos)
        (len_crc,) = struct.unpack_from("<I", blob, pos + 8)
        if masked(crc32c(blob[pos:pos + 8])) != len_crc:
            raise ValueError("bad length crc at byte %d" % pos)
        data = blob[pos + 12:pos + 12 + length]
        if len(data) != length or len(blob) < pos + 16 + length:
            raise ValueError("truncated record at byte %d" % pos)
        (data_crc,) = struct.unpack_from("<I", blob, pos + 12 + length)
        if masked(crc32c(data)) != data_crc:
            raise ValueError("bad data crc at byte %d" % pos)
        yield data
        pos += 16 + length


# ---- decoder 1: the protobuf library with a descriptor built from the .proto field numbers
def protobuf_decoder():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="pt_event.proto", package="tensorflow",
                                             syntax="proto3")

    def msg(name, fields):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        return m

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    msg("SummaryValue", [("tag", 1, F.TYPE_STRING, opt, None),
                         ("simple_value", 2, F.TYPE_FLOAT, opt, None)])
    msg("Summary", [("value", 1, F.TYPE_MESSAGE, rep, ".tensorflow.SummaryValue")])
    msg("Event", [("wall_time", 1, F.TYPE_DOUBLE, opt, None),
                  ("step", 2, F.TYPE_INT64, opt, None),
                  ("file_version", 3, F.TYPE_STRING, opt, None),
                  ("summary", 5, F.TYPE_MESSAGE, opt, ".tensorflow.Summary")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    desc = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        Event = message_factory.GetMessageClass(desc)
    else:
        Event = message_factory.MessageFactory(pool).GetPrototype(desc)

    def decode(data):
        ev = Event()
        ev.ParseFromString(data)
        out = {"wall_time": ev.wall_time, "step": ev.step}
        if ev.file_version:
            out["file_version"] = ev.file_version
        return out, [(v.tag, v.simple_value) for v in ev.summary.value]
    return decode


# ---- decoder 2: minimal protobuf wire-format parsing
def fields(buf):
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError("unsupported wire type %d" % wire)
        if pos > len(buf):
            raise ValueError("field %d runs past its message" % number)
        yield number, wire, value


def varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        result |= (b & 0x7F) << shift
        pos += 1
        shift += 7
        if not b & 0x80:
            return result, pos


def minimal_decode(data):
    out, values = {"wall_time": 0.0, "step": 0}, []
    for number, wire, value in fields(data):
        if number == 1 and wire == 1:
            out["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            out["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            out["file_version"] = value.decode()
        elif number == 5 and wire == 2:
            for n, w, v in fields(value):
                if n == 1 and w == 2:
                    tag, simple = None, None
                    for vn, vw, vv in fields(v):
                        if vn == 1 and vw == 2:
                            tag = vv.decode()
                        elif vn == 2 and vw == 5:
                            simple = struct.unpack("<f", vv)[0]
                    values.append((tag, simple))
    return out, values


def main(argv):
    decoder = "auto"
    args = []
    for a in argv[1:]:
        if a.startswith("--decoder="):
            decoder = a.split("=", 1)[1]
        else:
            args.append(a)
    if len(args) != 1:
        sys.stderr.write(__doc__)
        return 2
    if decoder in ("auto", "protobuf"):
        try:
            decode = protobuf_decoder()
            decoder = "protobuf"
        except ImportError:
            if decoder == "protobuf":
                sys.stderr.write("python3-protobuf is not installed\n")
                return 3
            decode, decoder = minimal_decode, "minimal"
    else:
        decode = minimal_decode
    with open(args[0], "rb") as f:
        blob = f.read()
    try:
        for data in records(blob):
            head, values = decode(data)
            if not values:
                print(json.dumps(dict(head, decoder=decoder)))
            for tag, value in values:
                print(json.dumps(dict(head, tag=tag, value=value, decoder=decoder)))
    except Exception as e:  # corruption of any kind: one line, exit 1
        sys.stderr.write("error: %s: %s\n" % (args[0], e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
