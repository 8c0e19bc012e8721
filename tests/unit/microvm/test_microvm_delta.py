"""A suspended VM's state cut to a delta against the template (microvm.delta), on streams built
here in QEMU 7.2's format: loading the delta over the template gives exactly the RAM that loading
the whole stream into empty memory gives (re-sent pages, zero pages, other blocks included), and
a stream of any other form is refused, never cut."""

from __future__ import annotations

import pathlib
import struct

import pytest

from cc_server.microvm.delta import PAGE, DeltaRefused, write_delta

RAM_PAGES = 16
ZERO, MEM_SIZE, DATA, EOS, CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
SECTION = 2
TAIL = b"\x04\x00\x00\x00\x03\x05timer\x00\x00\x00\x00\x00\x00\x00\x01devices\x00\x00"


def be32(v: int) -> bytes:
    return struct.pack(">I", v)


def be64(v: int) -> bytes:
    return struct.pack(">Q", v)


def idstr(name: str) -> bytes:
    return bytes([len(name)]) + name.encode()


def page(byte: int) -> bytes:
    return bytes([byte]) * PAGE


Entry = tuple[str, int, int, bytes]  # block, page index, ZERO or DATA, the fill byte or page


def entries(items: list[Entry]) -> bytes:
    out, last = b"", None
    for block, index, kind, value in items:
        flags = kind | (CONTINUE if block == last else 0)
        out += be64(index * PAGE | flags) + (b"" if block == last else idstr(block)) + value
        last = block
    return out + be64(EOS)


def stream(*sections: tuple[int, list[Entry]], blocks: dict[str, int] | None = None,
           start: bytes | None = None, tail: bytes = TAIL) -> bytes:
    blocks = blocks or {"mem0": RAM_PAGES * PAGE, "pc.bios": 2 * PAGE}
    footer = b"\x7e" + be32(SECTION)
    out = b"QEVM" + be32(3) + b"\x07" + be32(7) + b"microvm"
    out += start if start is not None else (b"\x01" + be32(SECTION) + idstr("ram") + be32(0)
                                            + be32(4))
    out += be64(sum(blocks.values()) | MEM_SIZE)
    out += b"".join(idstr(name) + be64(size) for name, size in blocks.items())
    out += be64(EOS) + footer
    for kind, items in sections:
        out += bytes([kind]) + be32(SECTION) + entries(items) + footer
    return out + tail


def load(data: bytes, ram: bytearray) -> tuple[dict[str, bytes], bytes]:
    """What QEMU's loader makes of `data` over `ram`: the pages of other blocks, and the tail."""
    at = data.index(b"\x03ram") + 12
    (total,) = struct.unpack_from(">Q", data, at)
    at += 8
    total &= ~(PAGE - 1)
    while total:
        n = data[at]
        at += 1 + n
        total -= struct.unpack_from(">Q", data, at)[0]
        at += 8
    others: dict[str, bytes] = {}
    block = ""
    while True:
        (entry,) = struct.unpack_from(">Q", data, at)
        at += 8
        flags, addr = entry & (PAGE - 1), entry & ~(PAGE - 1)
        if flags == EOS:
            at += 5  # footer
            if data[at] in (0x02, 0x03):
                at += 5
                continue
            return others, data[at:]
        if not flags & CONTINUE:
            block = data[at + 1:at + 1 + data[at]].decode()
            at += 1 + data[at]
        value = page(data[at]) if flags & ZERO else data[at:at + PAGE]
        at += 1 if flags & ZERO else PAGE
        if block == "mem0":
            ram[addr:addr + PAGE] = value
        else:
            others[f"{block}@{addr}"] = value


def cut(tmp_path: pathlib.Path, data: bytes, template: bytes) -> bytes:
    full, out, ram = tmp_path / "full", tmp_path / "delta", tmp_path / "ram.img"
    full.write_bytes(data)
    ram.write_bytes(template)
    write_delta(full, out, ram)
    return out.read_bytes()


def test_the_delta_over_the_template_loads_the_same_ram_as_the_whole_stream(
    tmp_path: pathlib.Path,
) -> None:
    template = b"".join(page(i) if i % 3 else page(0) for i in range(RAM_PAGES))
    data = stream(
        (0x02, [("mem0", i, DATA, page(i)) if i % 3 else ("mem0", i, ZERO, b"\0")
                for i in range(RAM_PAGES)]  # the first pass: the template's own pages
         + [("pc.bios", 0, DATA, page(0xAA)), ("pc.bios", 1, ZERO, b"\0")]),
        (0x02, [("mem0", 1, DATA, page(0xEE)),  # changed, then back as the template has it
                ("mem0", 2, DATA, page(0xEE)),  # changed for good
                ("mem0", 4, ZERO, b"\0"),  # zeroed where the template is not
                ("mem0", 3, DATA, page(0xEE))]),  # where the template is zero
        (0x03, [("mem0", 1, DATA, page(1)), ("mem0", 5, DATA, page(0x55)),
                ("mem0", 5, DATA, page(0x56))]),  # sent twice in one section: the last counts
    )
    whole = bytearray(RAM_PAGES * PAGE)
    whole_others, whole_tail = load(data, whole)
    delta = cut(tmp_path, data, template)
    over = bytearray(template)
    delta_others, delta_tail = load(delta, over)
    assert over == whole
    assert delta_others == whole_others and delta_tail == whole_tail == TAIL
    assert len(delta) < len(data) - 10 * PAGE
    # Only the pages that differ from the template are left: 2, 3, 4 and 5.
    assert delta.count(page(0xEE)) == 2 and page(0x56) in delta and page(0x55) not in delta


def test_a_template_differing_everywhere_keeps_every_page(tmp_path: pathlib.Path) -> None:
    data = stream((0x03, [("mem0", i, DATA, page(7)) for i in range(RAM_PAGES)]))
    template = page(8) * RAM_PAGES
    over = bytearray(template)
    load(cut(tmp_path, data, template), over)
    assert over == page(7) * RAM_PAGES


FIRST_PASS = (0x02, [("mem0", i, DATA, page(1)) for i in range(RAM_PAGES)])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(stream(FIRST_PASS), "did not end", id="no-end-section"),
        pytest.param(stream((0x03, FIRST_PASS[1][1:])), "every page", id="a-page-never-sent"),
        pytest.param(stream(FIRST_PASS, (0x03, [("mem0", 0, 0x40, b"\x01\x00\x00")])),
                     "flags 0x40", id="xbzrle-page"),
        pytest.param(stream(FIRST_PASS, (0x03, [("mem0", RAM_PAGES, DATA, page(1))])),
                     "outside the known blocks", id="page-past-block"),
        pytest.param(stream(FIRST_PASS, (0x03, [("other", 0, DATA, page(1))])),
                     "outside the known blocks", id="unknown-block"),
        pytest.param(stream((0x03, []), blocks={"mem0": 2 * RAM_PAGES * PAGE}),
                     "template's size", id="ram-not-the-templates-size"),
        pytest.param(stream((0x03, []), start=b"\x01" + be32(SECTION) + idstr("block")
                            + be32(0) + be32(1)), "not RAM", id="another-iterable-first"),
        pytest.param(stream(FIRST_PASS, (0x03, []), tail=b"\x01" + be32(3) + idstr("dirty")),
                     "another iterable section", id="another-iterable-after"),
        pytest.param(stream(FIRST_PASS, (0x03, []))[:-len(TAIL) - 100], "ends early",
                     id="cut-short"),
        pytest.param(b"QEVM" + be32(2), "version 3", id="old-version"),
    ],
)
def test_a_stream_of_another_form_is_refused(tmp_path: pathlib.Path, data: bytes,
                                             reason: str) -> None:
    with pytest.raises(DeltaRefused, match=reason):
        cut(tmp_path, data, page(0) * RAM_PAGES)
    assert not (tmp_path / "delta").exists() and not (tmp_path / "delta.part").exists()
