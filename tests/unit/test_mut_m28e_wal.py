"""check_wal and db_header against logs and headers written by hand from SQLite's documented file format.

The oracle: SQLite's WAL format (a 32-byte header, frames of a 24-byte header and one page, the
checksum ``s0 += a + s1; s1 += b + s0`` over 32-bit word pairs in the header magic's byte order),
written here in plain Python, and checked once against a log SQLite itself wrote.
"""

import shutil
import sqlite3
import struct

import numpy as np
import pytest

from kvservice.state.sqlite.wal import WalReport, check_wal, db_header

PAGE = 512
VERSION = 3007000


def cksum(data: bytes, s: tuple[int, int], big: bool) -> tuple[int, int]:
    s0, s1 = s
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    for a, b in zip(words[0::2], words[1::2], strict=True):
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
    return s0, s1


class Log:
    """A write-ahead log built frame by frame, each frame chained to the previous one's checksum."""

    def __init__(self, rng, big: bool = False, page: int = PAGE):
        self.big, self.page, self.rng = big, page, rng
        self.salt = (int(rng.integers(1, 2**32)), int(rng.integers(1, 2**32)))
        head = struct.pack(">6I", 0x377F0683 if big else 0x377F0682, VERSION, page, 3, *self.salt)
        self.head = head + struct.pack(">2I", *cksum(head, (0, 0), big))
        self.frames: list[bytes] = []
        self.last = cksum(head, (0, 0), big)

    def add(self, commit: int = 0, pgno: int | None = None, salt=None, page: bytes | None = None) -> bytes:
        page = page if page is not None else self.rng.bytes(self.page)
        pg = pgno if pgno is not None else int(self.rng.integers(1, 50))
        fh8 = struct.pack(">2I", pg, commit)
        s = cksum(fh8 + page, self.last, self.big)
        self.last = s
        frame = fh8 + struct.pack(">4I", *(salt or self.salt), *s) + page
        self.frames.append(frame)
        return frame

    def write(self, path, tail: bytes = b"") -> None:
        path.write_bytes(self.head + b"".join(self.frames) + tail)


def flip(frame: bytes, byte: int, bit: int) -> bytes:
    return frame[:byte] + bytes([frame[byte] ^ (1 << bit)]) + frame[byte + 1:]


def word_bit(byte_in_page: int, bit: int, big: bool) -> tuple[int, int]:
    """The checksummed word (the frame header's 2 words come first) and bit a page byte's bit lands in."""
    k = byte_in_page % 4
    return 2 + byte_in_page // 4, 8 * (3 - k if big else k) + bit


@pytest.mark.parametrize("big", [False, True])
def test_an_intact_log_is_counted_frame_by_frame(tmp_path, big):
    rng = np.random.default_rng(31 + big)
    log = Log(rng, big)
    for commit in (0, 0, 7, 0, 9, 0):
        log.add(commit)
    p = tmp_path / "x-wal"
    log.write(p)
    assert check_wal(p, PAGE) == WalReport(6, 6, 5, 1)                  # frame 6 has no commit: torn
    log.write(p, tail=rng.bytes(100))                                   # a partial frame: torn too
    assert check_wal(p, PAGE) == WalReport(6, 6, 5, 2)
    log.add(12)
    log.write(p)
    assert check_wal(p, PAGE) == WalReport(7, 7, 7, 0)
    log.write(p, tail=rng.bytes(24 + PAGE - 1))
    assert check_wal(p, PAGE) == WalReport(7, 7, 7, 1)


def test_a_log_written_by_sqlite_verifies_with_this_model_and_with_check_wal(tmp_path):
    db = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    db.execute("PRAGMA page_size=1024")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE t(x BLOB)")
    rng = np.random.default_rng(8)
    for _ in range(6):
        db.execute("INSERT INTO t VALUES (?)", (rng.bytes(int(rng.integers(10, 3000))),))
    shutil.copyfile(tmp_path / "a.db-wal", tmp_path / "copy-wal")
    db.close()
    data = (tmp_path / "copy-wal").read_bytes()
    big = bool(struct.unpack(">I", data[:4])[0] & 1)
    s = cksum(data[:24], (0, 0), big)
    assert struct.unpack(">2I", data[24:32]) == s
    n = (len(data) - 32) // (24 + 1024)
    commits = 0
    for f in range(n):
        fr = data[32 + f * (24 + 1024):32 + (f + 1) * (24 + 1024)]
        s = cksum(fr[:8] + fr[24:], s, big)
        assert struct.unpack(">2I", fr[16:24]) == s
        commits = f + 1 if struct.unpack(">I", fr[4:8])[0] else commits
    assert commits == n > 6
    assert check_wal(tmp_path / "copy-wal", 1024) == WalReport(n, n, n, 0)


@pytest.mark.parametrize("big", [False, True])
def test_a_garbled_last_commit_is_a_torn_tail_and_damage_before_an_intact_frame_is_refused(tmp_path, big):
    rng = np.random.default_rng(40 + big)
    log = Log(rng, big)
    for commit in (0, 4, 0, 0, 6):
        log.add(commit)
    good = list(log.frames)
    p = tmp_path / "x-wal"
    # the last commit's frames garbled over many bytes (a torn write): dropped, not damage
    log.frames[3] = good[3][:24] + rng.bytes(PAGE)
    log.frames[4] = good[4][:24] + rng.bytes(PAGE)
    log.write(p)
    assert check_wal(p, PAGE) == WalReport(5, 3, 2, 3)
    # the same garbling in frame 1, with frames 2.. intact and chained: the log was damaged
    log.frames = list(good)
    log.frames[1] = good[1][:24 + 100] + rng.bytes(50) + good[1][24 + 150:]
    log.write(p)
    rep = check_wal(p, PAGE)
    assert (rep.frames, rep.valid, rep.committed, rep.torn) == (5, 1, 0, 0)
    assert rep.problem == ("x-wal: frame 1 of 5 fails its checksum but frame 2 after it is intact: the log was "
                           "damaged; SQLite would drop it and the 3 frames after it, commits included")


@pytest.mark.parametrize("big", [False, True])
def test_one_flipped_bit_in_a_last_frame_is_named_by_word_and_bit(tmp_path, big):
    rng = np.random.default_rng(50 + big)
    p = tmp_path / "x-wal"
    for trial in range(6):
        log = Log(rng, big)
        for commit in (0, 3, 0, 5):
            log.add(commit)
        k = int(rng.integers(2, 4))
        # low bits: high bits of different words can change the checksum alike (then it names them all)
        wi, b = int(rng.integers(0, PAGE // 4)), int(rng.integers(0, 16))
        byte, bit = 4 * wi + (3 - b // 8 if big else b // 8), b % 8
        w, b = word_bit(byte, bit, big)
        frame = log.frames[k]
        log.frames[k] = flip(frame, 24 + byte, bit)
        log.frames[k + 1:] = []                                  # nothing after it: not provably damage by chaining
        log.write(p)
        rep = check_wal(p, PAGE)
        assert (rep.frames, rep.valid, rep.committed, rep.torn) == (k + 1, k, 2, 0), trial
        assert rep.problem == (f"x-wal: frame {k} of {k + 1}: one flipped bit (bit {b} of checksummed word {w}); "
                               "SQLite would drop it and the 0 frames after it, commits included"), trial
    # a bit of the frame header's commit field (word 1)
    log = Log(rng, big)
    log.add(0)
    log.add(0)
    log.frames[1] = flip(log.frames[1], 7, 2)
    log.write(p)
    b = 2 if big else 26                # byte 7 is the commit field's last byte: read in the log's word order
    assert check_wal(p, PAGE).problem == (f"x-wal: frame 1 of 2: one flipped bit (bit {b} of checksummed word 1); "
                                          "SQLite would drop it and the 0 frames after it, commits included")


@pytest.mark.parametrize("word", [0, 1])
def test_one_flipped_bit_of_a_stored_checksum_is_named(tmp_path, word):
    rng = np.random.default_rng(60 + word)
    log = Log(rng)
    log.add(2)
    log.add(0)
    bit = int(rng.integers(0, 32))
    byte = 16 + 4 * word + 3 - bit // 8            # the stored checksum is big-endian
    log.frames[1] = flip(log.frames[1], byte, bit % 8)
    p = tmp_path / "x-wal"
    log.write(p)
    rep = check_wal(p, PAGE)
    assert (rep.valid, rep.committed) == (1, 1)
    assert rep.problem == (f"x-wal: frame 1 of 2: one flipped bit (in its stored checksum, bit {bit} of word {word}); "
                           "SQLite would drop it and the 0 frames after it, commits included")


def test_frames_of_an_earlier_generation_and_a_damaged_salt(tmp_path):
    rng = np.random.default_rng(70)
    log = Log(rng)
    log.add(0)
    log.add(2)
    old = Log(rng)                                          # another generation: other salts
    for c in (0, 0, 5):
        old.add(c)
    log.frames += old.frames
    p = tmp_path / "x-wal"
    log.write(p)
    assert check_wal(p, PAGE) == WalReport(5, 2, 2, 0)
    # a salt bit flipped in a frame otherwise chained to its predecessor: damage, not a leftover
    log = Log(rng)
    for c in (0, 2, 0, 4):
        log.add(c)
    log.frames[2] = flip(log.frames[2], 8, 0)
    log.write(p)
    rep = check_wal(p, PAGE)
    assert (rep.valid, rep.committed, rep.torn) == (2, 2, 0)
    assert rep.problem == "x-wal: frame 2 of 4 has a damaged salt; SQLite would drop it and the 1 frames after it, " \
                          "commits included"
    # an unchained foreign frame followed by one of the log's own frames: damage
    log = Log(rng)
    for c in (0, 2, 0, 4):
        log.add(c)
    f2 = flip(log.frames[2], 12, 5)
    log.frames[2] = f2[:24] + rng.bytes(PAGE)
    log.write(p)
    rep = check_wal(p, PAGE)
    assert rep.problem == "x-wal: frame 2 of 4 is damaged (frame 3 after it belongs to the log); SQLite would " \
                          "drop it and the 1 frames after it, commits included"


def test_a_frame_for_page_zero_ends_the_valid_frames(tmp_path):
    rng = np.random.default_rng(80)
    log = Log(rng)
    log.add(0)
    log.add(3)
    log.add(0, pgno=0)
    log.write(tmp_path / "x-wal")
    rep = check_wal(tmp_path / "x-wal", PAGE)
    assert (rep.frames, rep.valid, rep.committed) == (3, 2, 2)


def test_a_damaged_log_header_is_reported_with_its_fields(tmp_path):
    rng = np.random.default_rng(90)
    log = Log(rng)
    for c in (0, 1, 0):
        log.add(c)
    p = tmp_path / "x-wal"
    good = log.head
    tail = "; SQLite would ignore its 3 frames"
    for head, words in [
        (struct.pack(">I", 0x377F0684) + good[4:], "magic 0x377f0684, version 3007000, page size 512"),
        (good[:4] + struct.pack(">I", 3007001) + good[8:], "magic 0x377f0682, version 3007001, page size 512"),
        (good[:8] + struct.pack(">I", 1024) + good[12:], "magic 0x377f0682, version 3007000, page size 1024"),
    ]:
        p.write_bytes(head + b"".join(log.frames))
        assert check_wal(p, PAGE) == WalReport(3, 0, 0, 0, f"x-wal: header damaged ({words} for a 512-byte "
                                               f"database){tail}")
    p.write_bytes(flip(good, 17, 3) + b"".join(log.frames))
    assert check_wal(p, PAGE) == WalReport(3, 0, 0, 0, "x-wal: header checksum mismatch; SQLite would ignore its "
                                                       "3 frames")
    p.write_bytes(good + log.frames[0][:-1])
    assert check_wal(p, PAGE) == WalReport(0, 0, 0, 0)


def sqlite_header(page_field: int, modes: tuple[int, int] = (2, 2)) -> bytes:
    h = bytearray(b"SQLite format 3\x00" + bytes(84))
    h[16:18] = struct.pack(">H", page_field)
    h[18], h[19] = modes
    return bytes(h)


@pytest.mark.parametrize(("field", "want"), [(512, 512), (4096, 4096), (32768, 32768), (1, 65536)])
def test_db_header_reads_the_page_size_field(tmp_path, field, want):
    p = tmp_path / "s.db"
    p.write_bytes(sqlite_header(field) + bytes(200))
    assert db_header(p) == (want, None)
    p.write_bytes(sqlite_header(field, (1, 1)))
    size, problem = db_header(p)
    assert size == want and problem.startswith("s.db: header says journal mode 1/1, not WAL (2/2)")
    p.write_bytes(sqlite_header(field, (2, 1)))
    assert "journal mode 2/1" in db_header(p)[1]


@pytest.mark.parametrize("field", [0, 256, 1000, 4095, 3 * 1024])
def test_db_header_refuses_a_damaged_page_size(tmp_path, field):
    p = tmp_path / "s.db"
    p.write_bytes(sqlite_header(field))
    assert db_header(p) == (0, f"s.db: page size field damaged ({field})")


def test_db_header_of_a_real_database_and_of_other_files(tmp_path):
    db = sqlite3.connect(tmp_path / "r.db")
    db.execute("PRAGMA page_size=8192")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t(x)")
    db.commit()
    db.close()
    assert db_header(tmp_path / "r.db") == (8192, None)
    (tmp_path / "short.db").write_bytes(sqlite_header(4096)[:99])
    (tmp_path / "other.db").write_bytes(b"SQLite format 4\x00" + bytes(84))
    for name in ("short.db", "other.db"):
        assert db_header(tmp_path / name) == (0, f"{name} is not an SQLite database (header damaged or file "
                                                 "truncated)")


def test_a_flip_the_checksum_cannot_place_names_every_candidate(tmp_path):
    """Bit 31 of a word moves the checksum by 2^31 times its coefficient: words of the same parity look alike.

    The candidates are found here by brute force: every single-bit flip of the frame, checksummed by the model."""
    rng = np.random.default_rng(99)
    log = Log(rng, page=PAGE)
    log.add(0)
    log.add(4)
    frame = log.frames[1]
    wi = int(rng.integers(10, PAGE // 4))
    byte = 24 + 4 * wi + 3                                   # little-endian words: bit 31 lives in the last byte
    bad = flip(frame, byte, 7)
    log.frames[1] = bad
    p = tmp_path / "x-wal"
    log.write(p)
    stored = struct.unpack(">2I", bad[16:24])
    seed = struct.unpack(">2I", log.frames[0][16:24])
    covered = bytearray(bad[:8] + bad[24:])
    hits = []
    for w in range(len(covered) // 4):
        for b in range(32):
            covered[4 * w + b // 8] ^= 1 << (b % 8)
            if cksum(bytes(covered), seed, False) == stored:
                hits.append((w, b))
            covered[4 * w + b // 8] ^= 1 << (b % 8)
    assert (2 + wi, 31) in hits and len(hits) > 4
    w, b = hits[0]
    others = ", ".join(f"bit {b2} of word {w2}" for w2, b2 in hits[1:4])
    assert check_wal(p, PAGE).problem == (
        f"x-wal: frame 1 of 2: one flipped bit (bit {b} of checksummed word {w}, or any of {len(hits) - 1} other "
        f"places the checksum cannot tell apart: {others} and {len(hits) - 4} more); SQLite would drop it and the 0 "
        "frames after it, commits included")
