"""A suspended VM's state as a delta against the snapshot its RAM was restored from.

A session's VM maps the template's RAM file copy-on-write, so most of its RAM is still the
template's pages. Its full saved state (QEMU's migration stream, every page of guest RAM) is
rewritten here to carry only the pages whose final content differs from the template's; a
resume then maps the template like a new session and loads just those, instead of writing
~60 MB into fresh memory.

The stream format is QEMU 7.2's (migration/savevm.c and ram.c): the header and configuration,
the iterable "ram" section (START, PARTs, END: page entries up to an end-of-section flag, each
section followed by a footer), then the devices' sections, copied as they are. Anything else
(another iterable section, a compressed or XBZRLE page, a block of another size) is refused:
the caller keeps the full state.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["DeltaRefused", "write_delta"]

PAGE: Final = 4096  # TARGET_PAGE_SIZE on x86
RAM_BLOCK: Final = "mem0"  # the guest RAM's memory backend id (vm.qemu_argv)
_MAGIC: Final = b"QEVM\x00\x00\x00\x03"
_CONFIGURATION, _START, _PART, _END, _FOOTER = 0x07, 0x01, 0x02, 0x03, 0x7E
_F_ZERO, _F_MEM_SIZE, _F_PAGE, _F_EOS, _F_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
_KNOWN_FLAGS: Final = _F_ZERO | _F_MEM_SIZE | _F_PAGE | _F_EOS | _F_CONTINUE
_BE32 = struct.Struct(">I")
_BE64 = struct.Struct(">Q")


class DeltaRefused(Exception):
    """The stream is not one this module can rewrite exactly."""


@dataclass(slots=True)
class _Reader:
    buf: mmap.mmap | bytes
    at: int = 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.buf):
            raise DeltaRefused("the stream ends early")
        view = memoryview(self.buf)[self.at:self.at + n]
        self.at += n
        return view

    def u8(self) -> int:
        return self.take(1)[0]

    def be32(self) -> int:
        value: int = _BE32.unpack(self.take(4))[0]
        return value

    def be64(self) -> int:
        value: int = _BE64.unpack(self.take(8))[0]
        return value

    def idstr(self) -> str:
        return bytes(self.take(self.u8())).decode("latin-1")


def _idstr(name: str) -> bytes:
    raw = name.encode("latin-1")
    return bytes([len(raw)]) + raw


def write_delta(full: Path, out: Path, template_ram: Path) -> int:
    """Write `out`: the stream in `full` with each page of the guest RAM block left out whose
    last value in the stream equals the template's page at that offset (a destination that maps
    the template has it already). Returns the number of RAM pages kept.

    Raises:
        DeltaRefused: the stream is not of the expected form (`out` is not written).
        OSError: a file could not be read or written.
    """
    with open(full, "rb") as f, open(template_ram, "rb") as t:
        if os.fstat(f.fileno()).st_size == 0:
            raise DeltaRefused("empty stream")
        stream = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        template = mmap.mmap(t.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            chunks, kept = _rewrite(stream, template)
            tmp = out.with_name(out.name + ".part")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                with open(fd, "wb") as w:
                    w.writelines(chunks)
                os.replace(tmp, out)
            finally:
                if tmp.exists():
                    tmp.unlink()
            del chunks
        finally:
            template.close()
            stream.close()
    return kept


def _rewrite(stream: mmap.mmap, template: mmap.mmap) -> tuple[list[bytes], int]:
    r = _Reader(stream)
    if bytes(r.take(len(_MAGIC))) != _MAGIC:
        raise DeltaRefused("not a version 3 QEMU migration stream")
    if r.u8() != _CONFIGURATION:
        raise DeltaRefused("no configuration section")
    r.take(r.be32())  # the machine type's name
    head_end = r.at
    if r.u8() != _START:
        raise DeltaRefused("the first section is not the start of an iterable one")
    section = r.be32()
    if r.idstr() != "ram":
        raise DeltaRefused("the first iterable section is not RAM")
    r.take(8)  # instance and version
    start_header = bytes(stream[head_end:r.at])

    blocks: dict[str, int] = {}
    entry = r.be64()
    if entry & ~(PAGE - 1) == 0 or entry & (PAGE - 1) != _F_MEM_SIZE:
        raise DeltaRefused("the RAM section does not start with its block sizes")
    mem_size_at = r.at - 8
    total = entry & ~(PAGE - 1)
    while total > 0:
        name = r.idstr()
        length = r.be64()
        blocks[name] = length
        total -= length
    if total != 0 or RAM_BLOCK not in blocks or blocks[RAM_BLOCK] != len(template):
        raise DeltaRefused("the guest RAM block is not the template's size")
    mem_size = bytes(stream[mem_size_at:r.at])

    # The entries of each section, its footer, then the next section's header; a page's
    # value is kept as its offset in the stream (ZERO: its fill byte's).
    ram: dict[int, tuple[int, int]] = {}  # guest RAM offset -> (kind, where its value is)
    others: list[tuple[str, int, int, int]] = []  # other blocks' entries, in order
    block: str | None = None
    length = 0
    last = _START
    at = r.at
    size = len(stream)
    unpack64 = _BE64.unpack_from
    while True:
        while True:
            if at + 8 > size:
                raise DeltaRefused("the stream ends early")
            (entry,) = unpack64(stream, at)
            at += 8
            flags, addr = entry & (PAGE - 1), entry & ~(PAGE - 1)
            if flags == _F_EOS:
                break
            if flags & ~(_F_ZERO | _F_PAGE | _F_CONTINUE):
                raise DeltaRefused(f"unexpected RAM entry flags {flags:#x}")
            if not flags & _F_CONTINUE:
                n = stream[at]
                block = stream[at + 1:at + 1 + n].decode("latin-1")
                at += 1 + n
                length = blocks.get(block, 0)
            kind = flags & (_F_ZERO | _F_PAGE)
            if block is None or addr + PAGE > length or kind not in (_F_ZERO, _F_PAGE):
                raise DeltaRefused("a page outside the known blocks, or of an unknown kind")
            where = at
            at += 1 if kind == _F_ZERO else PAGE
            if at > size:
                raise DeltaRefused("the stream ends early")
            if block == RAM_BLOCK:
                ram[addr] = (kind, where)  # a page sent again: its last value counts
            else:
                others.append((block, addr, kind, where))
        r.at = at
        if r.u8() != _FOOTER or r.be32() != section:
            raise DeltaRefused("a RAM section without its footer")
        kind_at = r.at
        kind = r.u8()
        if kind in (_PART, _END):
            if r.be32() != section or last == _END:
                raise DeltaRefused("another iterable section between the RAM sections")
            last = kind
            at = r.at
            continue
        if kind == _START or last != _END:
            raise DeltaRefused("another iterable section, or a RAM section that did not end")
        tail_at = kind_at
        break
    if len(ram) != blocks[RAM_BLOCK] // PAGE:
        # A page the stream never sent would be the template's over the delta, but whatever the
        # destination had over the whole stream.
        raise DeltaRefused("the stream did not send every page of the guest RAM")

    zero_page = bytes(PAGE)
    out: list[bytes] = [bytes(stream[:head_end]), start_header, mem_size]
    previous: str | None = None

    def header(name: str, addr: int, kind: int) -> bytes:
        nonlocal previous
        if name == previous:
            return _BE64.pack(addr | kind | _F_CONTINUE)
        previous = name
        return _BE64.pack(addr | kind) + _idstr(name)

    def value(kind: int, where: int) -> bytes:
        return stream[where:where + (1 if kind == _F_ZERO else PAGE)]

    for name, addr, kind, where in others:
        out += [header(name, addr, kind), value(kind, where)]
    kept = 0
    for addr in sorted(ram):  # bytes compare at memcmp speed (memoryviews: 10x slower)
        kind, where = ram[addr]
        mine = template[addr:addr + PAGE]
        if kind == _F_ZERO:
            same = stream[where] == 0 and mine == zero_page
        else:
            same = stream[where:where + PAGE] == mine
        if not same:
            out += [header(RAM_BLOCK, addr, kind), value(kind, where)]
            kept += 1
    eos = _BE64.pack(_F_EOS)
    footer = bytes([_FOOTER]) + _BE32.pack(section)
    out += [eos, footer, bytes([_END]) + _BE32.pack(section), eos, footer, stream[tail_at:]]
    return out, kept

