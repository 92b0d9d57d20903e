"""Check an SQLite write-ahead log before SQLite reads it: damage must not pass for the end of the log.

SQLite reads ``state.db-wal`` frame by frame and stops at the first frame whose salt or chained
checksum does not match, taking everything after it for a write that a crash cut short. So one
flipped bit in the middle of the log silently drops every later commit. This module reads the log
itself (the file format is SQLite's documented one: a 32-byte header, then frames of a 24-byte
header and one page) and tells the two cases apart:

- a frame after the first bad one that was written in the same chain (its checksum verifies when
  seeded with its predecessor's stored checksum, and it carries the log's salts) proves the bad
  frame was damaged after it was written: **damage**;
- a bad frame that one flipped bit would make valid is **damage** (a torn write replaces whole
  sectors, never one bit);
- a bad frame with current salts and nothing valid after it is a **torn tail**: the last commit
  was cut short by a crash of the machine and was never acknowledged (SQLite fsyncs a commit
  before it returns). SQLite drops it; so do we, with a warning;
- frames with another salt after the valid ones are leftovers of an earlier log generation.

The checksum (SQLite ``walChecksumBytes``) runs over 32-bit word pairs: ``s0 += a + s1;
s1 += b + s0`` modulo 2^32. That recurrence is linear, so the contribution of every frame is
computed for all frames at once with NumPy, and the effect of flipping any single bit is a
precomputed vector (what lets us recognise a one-bit flip without trying 33,000 variants).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC_LE, MAGIC_BE = 0x377F0682, 0x377F0683      # checksums over little- / big-endian words
WAL_VERSION = 3007000
HEADER_BYTES, FRAME_HEADER_BYTES = 32, 24
_M = np.uint64(0xFFFFFFFF)
_LO = np.uint64(0xFFFF)
_S16 = np.uint64(16)


@dataclass(frozen=True, slots=True)
class WalReport:
    """What check_wal found.

    frames: complete frames in the file; valid: the frames SQLite will use (up to its stop);
    committed: valid frames up to the last commit frame; torn: frames of a cut-short last commit
    (dropped, never acknowledged); problem: None, or why the log is damaged (then do not serve).
    """

    frames: int
    valid: int
    committed: int
    torn: int
    problem: str | None = None


def db_header(path: Path) -> tuple[int, str | None]:
    """(page size, problem) of an SQLite database file's header (problem None if it is a WAL-mode database)."""
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        return 0, f"{path.name} is not an SQLite database (header damaged or file truncated)"
    size = struct.unpack(">H", head[16:18])[0]
    page_size = 65536 if size == 1 else size
    if page_size < 512 or page_size & (page_size - 1):
        return 0, f"{path.name}: page size field damaged ({size})"
    if head[18] != 2 or head[19] != 2:
        return page_size, (f"{path.name}: header says journal mode {head[18]}/{head[19]}, not WAL (2/2): the header is "
                           "damaged, and SQLite would ignore the write-ahead log and its commits")
    return page_size, None


def _mulmod(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(x * y) mod 2^32 for uint64 arrays of values < 2^32, without overflowing 64 bits."""
    return ((x & _LO) * y + ((((x >> _S16) * (y & _LO)) & _LO) << _S16)) & _M


def _powers(n: int) -> np.ndarray:
    """uint64 [n, 4]: row j = A^j mod 2^32 as (p00, p01, p10, p11), A = [[1, 1], [1, 2]] (one word pair)."""
    out = np.empty((n, 4), dtype=np.uint64)
    p = (1, 0, 0, 1)
    mask = 0xFFFFFFFF
    for j in range(n):
        out[j] = p
        p00, p01, p10, p11 = p
        p = ((p00 + p10) & mask, (p01 + p11) & mask, (p00 + 2 * p10) & mask, (p01 + 2 * p11) & mask)
    return out


def _apply(p: tuple[int, int, int, int], s: tuple[int, int]) -> tuple[int, int]:
    return (p[0] * s[0] + p[1] * s[1]) & 0xFFFFFFFF, (p[2] * s[0] + p[3] * s[1]) & 0xFFFFFFFF


def _header_checksum(words: list[int]) -> tuple[int, int]:
    s0 = s1 = 0
    for a, b in zip(words[0::2], words[1::2], strict=True):
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
    return s0, s1


def check_wal(path: Path, page_size: int) -> WalReport:
    """Read the WAL at path (for a database of page_size bytes per page) and report damage.

    Call it before SQLite opens the database: SQLite's own recovery would silently stop at damage.
    """
    data = path.read_bytes()
    frame_bytes = FRAME_HEADER_BYTES + page_size
    if len(data) < HEADER_BYTES + frame_bytes:        # no complete frame: nothing can be lost
        return WalReport(0, 0, 0, 0)
    head = struct.unpack(">8I", data[:HEADER_BYTES])
    magic, _version, _wal_page, _ckpt, salt1, salt2, hc0, hc1 = head
    num_frames = (len(data) - HEADER_BYTES) // frame_bytes
    damaged = _header_damage(path.name, data, head, num_frames, page_size)
    if damaged is not None:
        return damaged
    big = magic & 1
    body = np.frombuffer(data, dtype=np.uint8, count=num_frames * frame_bytes, offset=HEADER_BYTES)
    frames = body.reshape(num_frames, frame_bytes)
    fh = frames[:, :FRAME_HEADER_BYTES].copy().view(">u4").astype(np.uint64)      # [F, 6] big-endian fields
    pgno, commit, fsalt1, fsalt2, st0, st1 = (fh[:, i] for i in range(6))
    # Checksummed words: the frame header's first 8 bytes, then the page, in the log's word order.
    covered = np.concatenate((frames[:, :8], frames[:, FRAME_HEADER_BYTES:]), axis=1)
    words = covered.view(">u4" if big else "<u4").astype(np.uint64)               # [F, 2n]
    a, b = words[:, 0::2], words[:, 1::2]
    n = a.shape[1]
    pw = _powers(n + 1)
    rev = pw[n - 1::-1]                                                            # A^(n-1-i) for pair i
    v1 = (a + b) & _M
    c0 = (_mulmod(rev[:, 0], a).sum(axis=1) + _mulmod(rev[:, 1], v1).sum(axis=1)) & _M
    c1 = (_mulmod(rev[:, 2], a).sum(axis=1) + _mulmod(rev[:, 3], v1).sum(axis=1)) & _M
    an = tuple(int(x) for x in pw[n])
    stored = list(zip(st0.tolist(), st1.tolist(), strict=True))
    contrib = list(zip(c0.tolist(), c1.tolist(), strict=True))
    current = (fsalt1 == salt1) & (fsalt2 == salt2)

    def chained(f: int, seed: tuple[int, int]) -> tuple[int, int]:
        s = _apply(an, seed)
        return (s[0] + contrib[f][0]) & 0xFFFFFFFF, (s[1] + contrib[f][1]) & 0xFFFFFFFF

    seed = (hc0, hc1)
    valid = committed = 0
    for f in range(num_frames):
        if not current[f] or pgno[f] == 0 or chained(f, seed) != stored[f]:
            break
        seed = stored[f]
        valid = f + 1
        if commit[f]:
            committed = valid
    if valid == num_frames:       # a partial frame at the end (a write cut short) is a torn tail too
        partial = (len(data) - HEADER_BYTES) % frame_bytes > 0
        return WalReport(num_frames, valid, committed, num_frames - committed + partial)
    k = valid
    # Frames written in this chain verify against their predecessor's stored checksum.
    local = [chained(f, stored[f - 1] if f else (hc0, hc1)) == stored[f] for f in range(k, num_frames)]
    later = [k + i for i, ok in enumerate(local) if ok and i and current[k + i]]
    bit = _one_bit(words[k], pw, n, chained(k, seed), stored[k]) if current[k] and not later else None
    problem = _frame_damage(f"{path.name}: frame {k} of {num_frames}", num_frames - k - 1, bool(current[k]),
                            local[0], later, bit)
    if problem is None and not current[k]:
        return WalReport(num_frames, valid, committed, 0)       # leftovers of an earlier log generation
    if problem is not None:
        return WalReport(num_frames, valid, committed, 0, problem)
    return WalReport(num_frames, valid, committed, num_frames - committed)


def _header_damage(name: str, data: bytes, head: tuple[int, ...], num_frames: int, page_size: int) -> WalReport | None:
    """A report for a log whose header SQLite would refuse (then it ignores every frame), else None."""
    magic, version, wal_page, _ckpt, _salt1, _salt2, hc0, hc1 = head
    if magic not in (MAGIC_LE, MAGIC_BE) or version != WAL_VERSION or wal_page != page_size:
        return WalReport(num_frames, 0, 0, 0, f"{name}: header damaged (magic {magic:#x}, version {version}, "
                         f"page size {wal_page} for a {page_size}-byte database); SQLite would ignore its "
                         f"{num_frames} frames")
    hwords = list(struct.unpack(">6I" if magic & 1 else "<6I", data[:24]))
    if _header_checksum(hwords) != (hc0, hc1):
        return WalReport(num_frames, 0, 0, 0, f"{name}: header checksum mismatch; SQLite would ignore its "
                         f"{num_frames} frames")
    return None


def _frame_damage(where: str, after: int, current: bool, self_consistent: bool, later: list[int],
                  bit: int | None) -> str | None:
    """Why the first frame that does not verify is damage (the log lost commits), or None: a torn tail (the
    current log's last write cut short) or an earlier log generation's leftovers (not current).

    current: the frame carries the log's salts; self_consistent: it verifies against its own predecessor's
    stored checksum; later: frames after it that verify and belong to the log; bit: a single flipped bit
    that would explain the mismatch.
    """
    lost = f"SQLite would drop it and the {after} frames after it, commits included"
    if not current:
        if self_consistent:
            return f"{where} has a damaged salt; {lost}"
        if later:
            return f"{where} is damaged (frame {later[0]} after it belongs to the log); {lost}"
        return None
    if later:
        return f"{where} fails its checksum but frame {later[0]} after it is intact: the log was damaged; {lost}"
    if bit is not None:
        return f"{where}: one flipped bit ({bit}); {lost}"
    return None


def _one_bit(words: np.ndarray, pw: np.ndarray, n: int, computed: tuple[int, int],
             stored: tuple[int, int]) -> str | None:
    """Where one flipped bit explains a frame's checksum mismatch, or None (words: uint64 [2n] of the frame)."""
    for c in (0, 1):                                   # the stored checksum itself has the flipped bit
        x = computed[c] ^ stored[c]
        if computed[1 - c] == stored[1 - c] and x and not x & (x - 1):
            return f"in its stored checksum, bit {x.bit_length() - 1} of word {c}"
    need0 = np.uint64((stored[0] - computed[0]) & 0xFFFFFFFF)
    need1 = np.uint64((stored[1] - computed[1]) & 0xFFFFFFFF)
    bits = np.arange(32, dtype=np.uint64)
    pow2 = np.uint64(1) << bits                                        # [32]
    was_set = ((words[:, None] >> bits[None, :]) & np.uint64(1)).astype(bool)      # [2n, 32]
    delta = np.where(was_set, (np.uint64(1 << 32) - pow2) & _M, pow2)              # +-2^b mod 2^32
    rev = pw[n - 1::-1]                                                # [n, 4]
    pair = np.repeat(rev, 2, axis=0)                                   # word w -> its pair's matrix
    is_b = (np.arange(2 * n) % 2).astype(bool)
    # a word adds delta to v0 and v1; b word adds delta to v1 only
    k0 = np.where(is_b, pair[:, 1], (pair[:, 0] + pair[:, 1]) & _M)
    k1 = np.where(is_b, pair[:, 3], (pair[:, 2] + pair[:, 3]) & _M)
    e0 = _mulmod(np.broadcast_to(k0[:, None], delta.shape), delta)
    e1 = _mulmod(np.broadcast_to(k1[:, None], delta.shape), delta)
    hit = np.argwhere((e0 == need0) & (e1 == need1))
    if not len(hit):
        return None
    w, bit = (int(x) for x in hit[0])
    if len(hit) == 1:
        return f"bit {bit} of checksummed word {w}"
    # The checksum scales a flip of bit b by each word's coefficient mod 2^32: high bits of different words (bit 31
    # always) can change it alike, and then the checksum cannot tell which one flipped: name them, not a guess.
    others = ", ".join(f"bit {int(b)} of word {int(x)}" for x, b in hit[1:4])
    more = f" and {len(hit) - 4} more" if len(hit) > 4 else ""
    return (f"bit {bit} of checksummed word {w}, or any of {len(hit) - 1} other places the checksum cannot tell "
            f"apart: {others}{more}")


__all__ = ["WalReport", "check_wal", "db_header"]
