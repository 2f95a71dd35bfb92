"""tools/te_offline_bundle.py blanks the device code a library carries for other GPUs, in a
real ELF layout, and keeps every container's headers where the driver reads them."""

import struct

import pytest

from tools.te_offline_bundle import prune_fatbin

ELF_KIND, PTX_KIND = 2, 1
ENTRY_HEADER = 64


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, ENTRY_HEADER, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> bytes:
    """A 64-bit little-endian ELF image holding ``sections`` and a section-name table."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name in [*sections, ".shstrtab"])
    blobs = [*sections.values(), names]
    offset, placed = 64, []
    for blob in blobs:
        placed.append((offset, len(blob)))
        offset += (len(blob) + 7) // 8 * 8
    shoff = offset
    image = bytearray(b"\x7fELF" + bytes([2, 1, 1]) + bytes(57))
    struct.pack_into("<Q", image, 0x28, shoff)
    struct.pack_into("<HHH", image, 0x3A, 64, len(blobs) + 1, len(blobs))
    for (start, _), blob in zip(placed, blobs):
        image += bytes(start - len(image)) + blob
    image += bytes(shoff - len(image)) + bytes(64)  # the null section
    name_at = 1
    for (start, size), name in zip(placed, [*sections, ".shstrtab"]):
        image += struct.pack("<IIQQQQ", name_at, 1, 0, 0, start, size) + bytes(24)
        name_at += len(name) + 1
    return bytes(image)


def test_only_the_kept_architecture_and_older_ptx_survive(tmp_path):
    payloads = {("elf", 80): b"A" * 40, ("elf", 90): b"B" * 24, ("ptx", 80): b"C" * 16, ("ptx", 100): b"D" * 32,
                ("elf", 100): b"E" * 8}
    first = _container([_entry(ELF_KIND, 80, payloads["elf", 80]), _entry(ELF_KIND, 90, payloads["elf", 90])])
    second = _container([_entry(PTX_KIND, 80, payloads["ptx", 80]), _entry(PTX_KIND, 100, payloads["ptx", 100]),
                         _entry(ELF_KIND, 100, payloads["elf", 100])])
    fatbin = first + bytes(-len(first) % 8) + second
    library = tmp_path / "lib.so"
    original = _elf({".text": b"\x90" * 24, ".nv_fatbin": fatbin})
    library.write_bytes(original)

    totals = prune_fatbin(library, 90)

    pruned = library.read_bytes()
    assert len(pruned) == len(original)
    assert totals == {"kept": 24 + 16, "blanked": 40 + 32 + 8}
    for (kind, arch), payload in payloads.items():
        at = original.index(payload)
        kept = arch == 90 or (kind == "ptx" and arch <= 90)
        assert pruned[at:at + len(payload)] == (payload if kept else bytes(len(payload))), (kind, arch)
    # Headers and everything outside the blanked payloads are untouched.
    changed = [i for i, (a, b) in enumerate(zip(original, pruned)) if a != b]
    blanked = {i for (kind, arch), p in payloads.items() if not (arch == 90 or (kind == "ptx" and arch <= 90))
               for i in range(original.index(p), original.index(p) + len(p))}
    assert set(changed) == blanked


def test_a_file_that_is_not_a_library_with_device_code_is_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not an ELF file at all")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        prune_fatbin(text, 90)
    plain = tmp_path / "plain.so"
    plain.write_bytes(_elf({".text": b"\x90" * 8}))
    with pytest.raises(ValueError, match="no .nv_fatbin section"):
        prune_fatbin(plain, 90)
