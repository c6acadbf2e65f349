"""Our safetensors reader against the reference library, on a generated family of damaged files.

For every file: the reference (``safetensors.deserialize`` for raw bytes of every dtype, and
``safe_open``'s verdict) refuses it exactly when we do, our refusal is a one-line
:class:`BadInputError` naming the file, and what both accept reads to the same dtype, shape and
bytes. The one deliberate difference: tensors no numpy array can hold (sub-byte dtypes F4, F6_*;
shapes such as [0, 2**32, 2**32]), which the reference's header accepts but its own numpy
loader cannot load either, we refuse by name; they are counted apart.
Run with ``-s`` to see the summary by class.
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes  # noqa: F401  (the reference's numpy binding needs it for BF16)
import pytest
import safetensors

from ckptconv.commands.verification import check_source_layout
from ckptconv.errors import BadInputError
from ckptconv.dtypes import BITS as DTYPE_BITS
from ckptconv.read.safetensors_io import read_box, read_header
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli

Tensors = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape), in data order
BASES: dict[str, Tensors] = {
    "mixed": [("w", "F32", (3, 4)), ("b", "BF16", (5,)), ("i", "I64", (2, 2)), ("m", "U8", (7,)),
              ("e", "F16", (0, 3)), ("s", "F64", ()), ("q", "F8_E4M3", (2, 3)), ("c", "C64", (1,))],
    "single": [("x", "F32", (4,))],
    "two": [("a.weight", "BF16", (2, 2)), ("b.weight", "BF16", (2, 2))],
}
SUB_BYTE = {"F4", "F6_E2M3", "F6_E3M2"}
Case = tuple[str, str, bytes]  # (class, label, file bytes)


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BITS[dtype] // 8


def header_of(tensors: Tensors, offsets: list[tuple[int, int]] | None = None) -> dict:
    header, position = {}, 0
    for k, (name, dtype, shape) in enumerate(tensors):
        size = nbytes(dtype, shape)
        begin, end = offsets[k] if offsets else (position, position + size)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
        position += size
    return header


def data_of(tensors: Tensors, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(sum(nbytes(d, s) for _, d, s in tensors)))


def encode(header: dict | str | bytes, pad_to: int = 8) -> bytes:
    """JSON text padded with spaces to a multiple of ``pad_to``, as ``save_file`` does (8)."""
    text = header if isinstance(header, bytes) else (
        header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))).encode()
    return text + b" " * (-len(text) % pad_to)


def blob(header: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def good(base: str, pad_to: int = 8) -> tuple[bytes, bytes]:
    tensors = BASES[base]
    return encode(header_of(tensors), pad_to), data_of(tensors)


def entry_case(extra: str, data: bytes = bytes(range(8))) -> bytes:
    """One 8-byte tensor ``a`` whose header entry text is ``extra`` (raw JSON)."""
    return blob(encode('{"a":' + extra + "}"), data)


F32_8 = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]'


# --- the damaged files, by class ---------------------------------------------------------

def length_field() -> Iterator[Case]:
    """The 8-byte header length off by 1..8 either way, also with wide padding (the JSON still parses)."""
    for base, pad in (("mixed", 8), ("single", 8), ("two", 8), ("mixed", 64), ("single", 64)):
        header, data = good(base, pad)
        for delta in [*range(-8, 0), *range(1, 9)]:
            yield "length field +-1..8", f"{base}/pad{pad} {delta:+d}", blob(header, data, len(header) + delta)


def truncated() -> Iterator[Case]:
    for base in ("mixed", "two"):
        whole = blob(*good(base))
        n = len(good(base)[0])
        for cut in sorted({0, 1, 4, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, len(whole) // 2,
                           len(whole) - 4, len(whole) - 1}):
            yield "truncated", f"{base} cut at {cut}", whole[:cut]


def trailing() -> Iterator[Case]:
    for base in ("mixed", "single"):
        header, data = good(base)
        for extra in (b"\0", b"\0" * 3, b"\0" * 8, b" ", b"x" * 7, b"\0" * 64, b"\0" * 4096, data):
            yield "trailing bytes", f"{base} +{len(extra)}", blob(header, data + extra)


def offsets_gap_overlap() -> Iterator[Case]:
    tensors = BASES["mixed"]
    sizes = [nbytes(d, s) for _, d, s in tensors]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    data = data_of(tensors)
    for k in range(len(tensors)):
        for g in (1, 4, 8):  # gap before tensor k; the data holds the gap's bytes
            offsets = [(b + g * (j >= k), b + sizes[j] + g * (j >= k)) for j, b in enumerate(starts)]
            yield "offset gap", f"gap {g} before {tensors[k][0]}", blob(
                encode(header_of(tensors, offsets)), data[:starts[k]] + b"\0" * g + data[starts[k]:])
        if k and sizes[k]:
            for g in (1, 2, sizes[k - 1] or 1):  # tensor k starts g bytes early; the data is g bytes shorter
                offsets = [(b - g * (j >= k), b + sizes[j] - g * (j >= k)) for j, b in enumerate(starts)]
                yield "offset overlap", f"{tensors[k][0]} back {g}", blob(
                    encode(header_of(tensors, offsets)), data[:len(data) - g])


def offsets_order() -> Iterator[Case]:
    tensors = BASES["mixed"]
    data = data_of(tensors)
    header = header_of(tensors)
    for seed in range(4):  # names in any order, offsets still tiling: valid
        names = list(header)
        random.Random(seed).shuffle(names)
        yield "offset order", f"keys shuffled {seed}", blob(encode({n: header[n] for n in names}), data)
    two = header_of(BASES["two"])  # equal sizes, offsets swapped: valid, names read each other's bytes
    two["a.weight"]["data_offsets"], two["b.weight"]["data_offsets"] = [8, 16], [0, 8]
    yield "offset order", "same-size offsets swapped", blob(encode(two), data_of(BASES["two"]))
    for name in ("w", "b", "m"):
        reversed_ = header_of(tensors)
        reversed_[name]["data_offsets"].reverse()
        yield "offset order", f"{name} offsets reversed", blob(encode(reversed_), data)
    unordered = header_of(tensors)  # w and b exchange places but keep their sizes: overlap/gap
    unordered["w"]["data_offsets"], unordered["b"]["data_offsets"] = [10, 58], [0, 10]
    yield "offset order", "w after b (sizes kept)", blob(encode(unordered), data)


def shape_size() -> Iterator[Case]:
    tensors = BASES["mixed"]
    data = data_of(tensors)
    for k, (name, dtype, shape) in enumerate(tensors):
        variants = [shape + (1,), (1,) + shape, tuple(reversed(shape))]
        variants += [shape[:a] + (d + delta,) + shape[a + 1:] for a, d in enumerate(shape) for delta in (-1, 1)
                     if d + delta >= 0]
        variants += [(0,) + shape, shape[:-1] if shape else (1,)]
        for variant in variants:
            header = header_of(tensors)
            header[name]["shape"] = list(variant)
            yield "shape x itemsize vs bytes", f"{name} {list(shape)}->{list(variant)}", blob(encode(header), data)
        for other in ("F32", "BF16", "I64", "U8", "I32", "U16", "BOOL", "F8_E5M2", "F8_E8M0", "U64"):
            header = header_of(tensors)
            header[name]["dtype"] = other
            yield "shape x itemsize vs bytes", f"{name} {dtype}->{other}", blob(encode(header), data)


def dtypes() -> Iterator[Case]:
    for dtype in ("F128", "f32", "", "Float32", "BF 16", "F8_E4M3FN", "F32 ", "Q4_0"):
        yield "dtype", f"unknown {dtype!r}", entry_case(F32_8.replace('"F32"', json.dumps(dtype)) + "}")
    for raw in ('{"F32":null}', '{"F32":0}', '{"F32":[]}', '{}', '{"F32":null,"F16":null}', "null", "5",
                '["F32"]', 'true'):
        yield "dtype", f"dtype {raw}", entry_case(F32_8.replace('"F32"', raw) + "}")
    for dtype, count in (("F8_E8M0", 8), ("F8_E4M3FNUZ", 8), ("F8_E5M2FNUZ", 8), ("U32", 2), ("C64", 1),
                         ("BOOL", 8), ("I16", 4), ("F4", 16), ("F6_E2M3", 4), ("F6_E3M2", 3)):
        size = (count * DTYPE_BITS[dtype] + 7) // 8
        yield "dtype", f"{dtype} x{count}", blob(encode(header_of([("a", dtype, (count,))], [(0, size)])),
                                                 bytes(range(size)))


def utf8() -> Iterator[Case]:
    for label, raw in (("0xff", b"\xff"), ("0xc0 0x80 overlong NUL", b"\xc0\x80"), ("lone continuation", b"\x80"),
                       ("encoded surrogate", b"\xed\xa0\x80"), ("cut 3-byte", b"\xe6\x97"),
                       ("5-byte form", b"\xf8\x88\x80\x80\x80"), ("above U+10FFFF", b"\xf4\x90\x80\x80")):
        yield "UTF-8", f"name with {label}", blob(encode(b'{"a' + raw + b'":' + F32_8.encode() + b"}}"), bytes(8))
    for label, name in (("latin", "ñame"), ("CJK", "名字"), ("emoji", "😀"), ("NUL escape", "a\\u0000"),
                        ("newline escape", "a\\nb"), ("pair escape", "\\ud83d\\ude00")):
        yield "UTF-8", f"valid name: {label}", blob(encode(f'{{"{name}":{F32_8}}}}}'.encode()), bytes(8))
    yield "UTF-8", "BOM", blob(encode(b"\xef\xbb\xbf" + f'{{"a":{F32_8}}}}}'.encode()), bytes(8))


def json_text() -> Iterator[Case]:
    for label, text in (("array", "[]"), ("string", '"x"'), ("number", "5"), ("null", "null"), ("true", "true"),
                        ("missing brace", '{"a":' + F32_8 + "}"), ("trailing comma", '{"a":' + F32_8 + "},}"),
                        ("single quotes", "{'a':1}"), ("comment", '{/*c*/"a":' + F32_8 + "}}"),
                        ("two objects", '{"a":' + F32_8 + "}}{}"), ("raw control char", '{"a\x01":' + F32_8 + "}}"),
                        ("bad escape", '{"a\\x":' + F32_8 + "}}")):
        yield "JSON", label, blob(encode(text), bytes(range(8)))
    for label, value in (("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e400", "1e400"),
                         ("-1e400", "-1e400"), ("1e-400", "1e-400"), ("400-digit int", "9" * 400),
                         ("5000-digit int", "9" * 5000), ("30-digit int", "1" * 30), ("-0", "-0"), ("1.5", "1.5"),
                         ("lone high surrogate", '"\\ud800"'), ("lone low surrogate", '"\\udc00"'),
                         ("high then A", '"\\ud800\\u0041"'), ("valid pair", '"\\ud83d\\ude00"'),
                         ("object", '{"k":[1,{"z":null}]}'), ("duplicate extra keys", '1,"x":2'),
                         # what lies inside strings is neither nesting nor a number (strict_json empties strings
                         # by splitting at quotes when the text has no backslash, by a regex when it has one)
                         ("brackets in a string", '"' + "[" * 200 + '"'), ("digits in a string", '"' + "9" * 400 + '"'),
                         ("brackets after an escaped quote", '"\\"' + "{" * 200 + '"'),
                         ("digits after an escaped quote", '"\\"' + "9" * 400 + '"')):
        yield "JSON", f"extra field {label}", entry_case(F32_8 + ',"x":' + value + "}")
    for depth in (120, 124, 125, 126, 127, 200, 3000):  # the tensor object is at depth 2
        yield "JSON", f"nested {depth} in an extra field", entry_case(
            F32_8 + ',"x":' + "[" * depth + "]" * depth + "}")
    for label, text in (("shape 2.0", '"shape":[2.0]'), ("shape 2e0", '"shape":[2e0]'), ("shape true", '"shape":[true]'),
                        ("shape -2", '"shape":[-2]'), ("shape 2^64", '"shape":[18446744073709551616]'),
                        ("shape null", '"shape":null'), ("shape object", '"shape":{"0":2}'), ("shape 02", '"shape":[02]'),
                        ("shape '2'", '"shape":["2"]'), ("shape [[2]]", '"shape":[[2]]')):
        yield "JSON", label, entry_case(F32_8.replace('"shape":[2]', text) + "}")
    for label, text in (("-0", "[-0,8]"), ("three", "[0,8,8]"), ("one", "[0]"), ("float", "[0,8.0]"),
                        ("object", '{"0":0,"1":8}'), ("strings", '["0","8"]'), ("negative", "[-8,0]"),
                        ("2^64", "[0,18446744073709551616]")):
        yield "JSON", f"data_offsets {label}", entry_case(F32_8.replace("[0,8]", text) + "}")
    entry = F32_8 + "}"
    for label, text in (("dtype twice", F32_8 + ',"dtype":"F32"}'), ("shape twice", F32_8 + ',"shape":[2]}'),
                        ("no shape", '{"dtype":"F32","data_offsets":[0,8]}'), ("entry null", "null"),
                        ("entry array", '["F32",[2],[0,8]]'), ("entry array of 4", '["F32",[2],[0,8],1]'),
                        ("entry array of 2", '["F32",[2]]'), ("entry string", '"F32"')):
        yield "JSON", label, entry_case(text)
    zero = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    for label, text in (("name twice, same", f'{{"a":{entry},"a":{entry}}}'),
                        ("name twice, zero-sized first", f'{{"a":{zero},"a":{entry}}}'),
                        ("name twice, null first", f'{{"a":null,"a":{entry}}}'),
                        ("name twice, second at 8", f'{{"a":{entry},"a":' + F32_8.replace("[0,8]", "[8,16]") + "}}")):
        yield "duplicate keys", label, blob(encode(text), bytes(range(8)))


def metadata() -> Iterator[Case]:
    entry = '"a":' + F32_8 + "}"
    for label, value in (("strings", '{"format":"pt","k":"v"}'), ("null", "null"), ("empty", "{}"),
                         ("int value", '{"k":1}'), ("null value", '{"k":null}'), ("nested", '{"k":{"x":"y"}}'),
                         ("list", '["a"]'), ("string", '"pt"'), ("duplicate key", '{"k":"1","k":"2"}')):
        yield "__metadata__", label, blob(encode('{"__metadata__":' + value + "," + entry + "}"), bytes(8))
    yield "__metadata__", "after the tensors", blob(encode('{' + entry + ',"__metadata__":{"k":"v"}}'), bytes(8))
    yield "duplicate keys", "__metadata__ twice", blob(
        encode('{"__metadata__":{},' + entry + ',"__metadata__":null}'), bytes(8))


def huge_length() -> Iterator[Case]:
    header, data = good("single")
    size = 8 + len(header) + len(data)
    for length in (2**64 - 1, 2**63, 2**32, 100_000_001, 100_000_000, size, size - 7, size - 8):
        yield "huge length field", f"{length}", blob(header, data, length)
    wide = encode(header_of(BASES["single"]) | {"__metadata__": {"pad": "x" * 100_000}})  # a long but valid header
    yield "huge length field", "100 kB header", blob(wide, data)


def padding() -> Iterator[Case]:
    text = json.dumps(header_of(BASES["mixed"]), separators=(",", ":")).encode()
    data = data_of(BASES["mixed"])
    for label, pad in (("1 space", b" "), ("16 spaces", b" " * 16), ("tab", b"\t"), ("newline", b"\n"), ("CR LF", b"\r\n"),
                       ("NUL", b"\0"), ("8 NULs", b"\0" * 8), ("form feed", b"\x0c"), ("vertical tab", b"\x0b"),
                       ("NBSP", "\u00a0".encode()), ("ideographic space", "\u3000".encode())):
        yield "header padding", f"trailing {label}", blob(text + pad, data)
        yield "header padding", f"leading {label}", blob(pad + text, data)


def tiny() -> Iterator[Case]:
    for size in range(8):
        yield "empty or tiny file", f"{size} bytes", bytes(size)
    yield "empty or tiny file", "8 zero bytes", bytes(8)
    yield "empty or tiny file", "{} alone", blob(b"{}", b"")
    yield "empty or tiny file", "{} padded", blob(b"{}      ", b"")
    yield "empty or tiny file", "{} with data", blob(b"{}      ", b"\0" * 8)
    yield "empty or tiny file", "length 0 with data", blob(b"", b"{}")
    yield "empty or tiny file", "only spaces", blob(b"        ", b"")


def zero_sized() -> Iterator[Case]:
    z = '{"dtype":"F32","shape":[0],"data_offsets":[%d,%d]}'
    a = '{"dtype":"F32","shape":[2],"data_offsets":[%d,%d]}'
    for label, text in (("zero at start", '{"z":' + z % (0, 0) + ',"a":' + a % (0, 8) + "}"),
                        ("zero at end", '{"a":' + a % (0, 8) + ',"z":' + z % (8, 8) + "}"),
                        ("zero in the middle", '{"a":' + a.replace("[2]", "[1]") % (0, 4) + ',"z":' + z % (4, 4)
                         + ',"b":' + a.replace("[2]", "[1]") % (4, 8) + "}"),
                        ("two zeros tied", '{"z":' + z % (8, 8) + ',"y":' + z % (8, 8) + ',"a":' + a % (0, 8) + "}"),
                        ("zero past the end", '{"a":' + a % (0, 8) + ',"z":' + z % (9, 9) + "}"),
                        ("zero inside a tensor", '{"a":' + a % (0, 8) + ',"z":' + z % (4, 4) + "}"),
                        ("zero sized with bytes", '{"a":' + a % (0, 8) + ',"z":' + z % (8, 12) + "}"),
                        ("scalar", '{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}'),
                        ("[0, 2^32, 2^32]", '{"a":' + a % (0, 8) + ',"z":' + z.replace("[0]", "[0,4294967296,4294967296]")
                         % (8, 8) + "}"),
                        ("[2^32, 2^32, 0] overflows", '{"a":' + a % (0, 8) + ',"z":' + z.replace(
                            "[0]", "[4294967296,4294967296,0]") % (8, 8) + "}"),
                        ("[2^64-1, 0]", '{"a":' + a % (0, 8) + ',"z":' + z.replace("[0]", "[18446744073709551615,0]")
                         % (8, 8) + "}"),
                        ("[2^62] x F32 overflows", '{"a":' + a % (0, 8) + ',"z":' + z.replace("[0]", "[4611686018427387904]")
                         % (8, 8) + "}"),
                        ("all zero-sized, no data", '{"z":' + z % (0, 0) + ',"y":' + z % (0, 0) + "}")):
        data = b"" if "no data" in label else bytes(range(12 if "with bytes" in label else 8))
        yield "zero-sized tensors", label, blob(encode(text), data)


GENERATORS: tuple[Callable[[], Iterator[Case]], ...] = (
    length_field, truncated, trailing, offsets_gap_overlap, offsets_order, shape_size, dtypes, utf8, json_text,
    metadata, huge_length, padding, tiny, zero_sized)


# --- the two readers -----------------------------------------------------------------------

def reference(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """What the reference loads (None: it refuses); ``safe_open`` must agree with ``deserialize``."""
    try:
        loaded = {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
                  for name, t in safetensors.deserialize(path.read_bytes())}
    except safetensors.SafetensorError:
        loaded = None
    try:
        with safetensors.safe_open(str(path), "numpy"):
            opened = True
    except (safetensors.SafetensorError, OSError):
        opened = False
    assert opened == (loaded is not None), f"{path.name}: safe_open and deserialize disagree"
    return loaded


def no_array_can_hold(dtype: str, shape: tuple[int, ...]) -> bool:
    """Sub-byte dtypes, and shapes whose non-zero axes span 2**63 bytes: numpy has no array for them."""
    extent = 1
    for dim in shape:
        extent *= dim or 1
    return dtype in SUB_BYTE or extent * DTYPE_BITS[dtype] // 8 >= 2**63


def refused_by_design(path: Path, expected: dict, message: str) -> bool:
    """We refuse, naming a tensor no numpy array can hold, and the reference's numpy loader fails on it too."""
    for name, (dtype, shape, _) in expected.items():
        if no_array_can_hold(dtype, shape) and repr(name) in message and "is not supported" in message:
            with safetensors.safe_open(str(path), "numpy") as f:
                with pytest.raises(Exception):
                    f.get_tensor(name)
            return True
    return False


def ours(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | BadInputError:
    """What our reader reads (each tensor as one whole box), or the error it refuses with."""
    source = LocalSource(str(path.parent))
    try:
        infos = read_header(source, path.name)
        return {name: (_dtype_name(info.dtype), info.shape,
                       read_box(source, info, tuple((0, d) for d in info.shape)).tobytes())
                for name, info in infos.items()}
    except BadInputError as err:
        return err
    finally:
        source.close()


def _dtype_name(dtype) -> str:
    from ckptconv.dtypes import SAFETENSORS as DTYPES

    return next(name for name, known in DTYPES.items() if known == dtype)


def test_reader_matches_the_reference_on_damaged_files(tmp_path):
    tally: Counter = Counter()
    failures = []
    for generate in GENERATORS:
        for k, (kind, label, content) in enumerate(generate()):
            path = tmp_path / f"{generate.__name__}-{k}.safetensors"
            path.write_bytes(content)
            expected, got = reference(path), ours(path)
            tally[kind, "tried"] += 1
            if isinstance(got, BadInputError):
                message = str(got)
                clean = "\n" not in message and str(path) in message
                if not clean:
                    failures.append(f"{kind} / {label}: refusal is not one line naming the file: {message!r}")
                elif expected is None:
                    tally[kind, "rejected cleanly"] += 1
                elif refused_by_design(path, expected, message):
                    tally[kind, "refused by design"] += 1
                else:
                    failures.append(f"{kind} / {label}: the reference loads it, we refuse: {message}")
            elif expected is None:
                failures.append(f"{kind} / {label}: the reference refuses it, we read it")
            elif got != expected:
                failures.append(f"{kind} / {label}: read differently from the reference")
            else:
                tally[kind, "read identically"] += 1
            path.unlink()
    kinds = sorted({kind for kind, _ in tally})
    print("\nsafetensors differential (class: tried / rejected cleanly / read identically / refused by design)")
    for kind in kinds:
        print(f"  {kind:28s} {tally[kind, 'tried']:4d} {tally[kind, 'rejected cleanly']:4d} "
              f"{tally[kind, 'read identically']:4d} {tally[kind, 'refused by design']:4d}")
    totals = Counter()
    for (kind, what), count in tally.items():
        totals[what] += count
    print(f"  {'total':28s} {totals['tried']:4d} {totals['rejected cleanly']:4d} {totals['read identically']:4d} "
          f"{totals['refused by design']:4d}")
    assert not failures, "\n".join(failures[:30])
    assert totals["tried"] > 400 and totals["rejected cleanly"] > 250 and totals["read identically"] > 60
    assert len(kinds) >= 14


def test_verify_rederives_offsets_independently(tmp_path):
    """A reading shifted by one byte (the bug the strict reader now prevents) is caught by verify's own check."""
    header, data = good("mixed")
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob(header, data))
    source = LocalSource(str(tmp_path))
    infos = read_header(source, path.name)
    assert check_source_layout(source, infos.values()) == []
    shifted = [type(info)(info.name, info.file, info.dtype, info.shape, info.offset + 1) for info in infos.values()]
    problems = check_source_layout(source, shifted)
    assert len(problems) == len(shifted) and "read at byte" in problems[0]
    path.write_bytes(blob(header, data + b"\0"))  # trailing bytes: the tiling check fails on its own
    assert any("do not tile" in p for p in check_source_layout(LocalSource(str(tmp_path)), infos.values()))


@pytest.mark.parametrize("damage", ["length field -1", "trailing byte"])
def test_convert_refuses_damaged_shard_in_one_line(tmp_path, synth_dir, damage):
    src = synth_dir()
    path = src / "model.safetensors"
    content = path.read_bytes()
    length = int.from_bytes(content[:8], "little")
    path.write_bytes({"length field -1": (length - 1).to_bytes(8, "little") + content[8:],
                      "trailing byte": content + b"\0"}[damage])
    dst = tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--progress", "none")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("ckptconv: error: ") and result.stderr.count("\n") == 1
    assert str(path) in result.stderr and "Traceback" not in result.stderr
    assert not dst.exists()
