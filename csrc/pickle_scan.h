// Whether a pickle may go to CPython's C unpickler: fsdpfast._native.pickle_is_plain.
//
// The restricted unpickler (fsdpfast/_parsing/safe_load.py) runs checkpoint pickles through
// pickle's Python implementation because the C one grows its memo array to twice the largest
// index a PUT opcode names: five bytes of a crafted file make it allocate and clear gigabytes.
// The C unpickler is four times faster, so a pickle is handed to it when this scan, which runs
// no code and allocates nothing, finds it "plain": every opcode one that CPython's pickler
// writes (protocols 0 to 5, out-of-band buffers and the extension registry excepted), every
// argument inside the data, every memo slot written in order (the next free one, as CPython's
// pickler writes them) and every memo slot read already written. The memo then holds at most
// one slot per byte of the pickle. Anything else is left to the Python unpickler, which reads
// every pickle; so this scan only ever chooses the faster of two readers, never what is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fsdpfast {

namespace pickle_scan {

inline uint64_t little_endian(const unsigned char* p, size_t width) {
  uint64_t value = 0;
  for (size_t i = 0; i < width; ++i) value |= uint64_t(p[i]) << (8 * i);
  return value;
}

// A decimal memo index on a text line (protocol 0 PUT / GET); false if it is not one.
inline bool decimal(const unsigned char* p, size_t length, uint64_t& value) {
  if (length == 0 || length > 18) return false;
  value = 0;
  for (size_t i = 0; i < length; ++i) {
    if (p[i] < '0' || p[i] > '9') return false;
    value = value * 10 + (p[i] - '0');
  }
  return true;
}

}  // namespace pickle_scan

// nullptr if the pickle is plain (see above), else why not.
inline const char* pickle_not_plain(const unsigned char* p, size_t n) {
  using pickle_scan::little_endian;
  size_t i = 0;
  uint64_t memo = 0;  // slots written so far
  // The argument of the opcode at i - 1: `width` bytes, then (if `counted`) that many more.
  auto skip = [&](size_t width, bool counted) -> bool {
    if (n - i < width) return false;
    uint64_t extra = counted ? little_endian(p + i, width) : 0;
    i += width;
    if (extra > n - i) return false;
    i += size_t(extra);
    return true;
  };
  auto line = [&](const unsigned char*& start, size_t& length) -> bool {
    const void* end = std::memchr(p + i, '\n', n - i);
    if (end == nullptr) return false;
    start = p + i;
    length = size_t(static_cast<const unsigned char*>(end) - start);
    i += length + 1;
    return true;
  };
  const unsigned char* text;
  size_t length;
  while (i < n) {
    const unsigned char op = p[i++];
    switch (op) {
      case '.':  // STOP: what follows is not read
        return nullptr;
      // no argument
      case '(': case '0': case '1': case '2': case 'N': case 'Q': case 'R': case 'a': case 'b': case 'd': case '}':
      case 'e': case 'l': case ']': case 'o': case 's': case 't': case ')': case 'u': case 0x81: case 0x85: case 0x86:
      case 0x87: case 0x88: case 0x89: case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93:
        break;
      case 0x94:  // MEMOIZE: the next slot
        ++memo;
        break;
      // fixed-width arguments
      case 'K': case 0x80: if (!skip(1, false)) return "truncated"; break;
      case 'M': if (!skip(2, false)) return "truncated"; break;
      case 'J': if (!skip(4, false)) return "truncated"; break;
      case 'G': case 0x95: if (!skip(8, false)) return "truncated"; break;
      // counted arguments
      case 'U': case 'C': case 0x8a: case 0x8c: if (!skip(1, true)) return "truncated"; break;
      case 'T': case 'X': case 'B': case 0x8b: if (!skip(4, true)) return "truncated"; break;
      case 0x8d: case 0x8e: case 0x96: if (!skip(8, true)) return "truncated"; break;
      // text lines
      case 'F': case 'I': case 'L': case 'P': case 'S': case 'V':
        if (!line(text, length)) return "truncated";
        break;
      case 'c': case 'i':  // module and name
        if (!line(text, length) || !line(text, length)) return "truncated";
        break;
      // the memo
      case 'q': case 'r': case 'p': {
        uint64_t index;
        if (op == 'p') {
          if (!line(text, length) || !pickle_scan::decimal(text, length, index)) return "a PUT that is not a memo index";
        } else {
          const size_t width = op == 'q' ? 1 : 4;
          if (n - i < width) return "truncated";
          index = little_endian(p + i, width);
          i += width;
        }
        if (index != memo) return "a memo slot written out of order";
        ++memo;
        break;
      }
      case 'h': case 'j': case 'g': {
        uint64_t index;
        if (op == 'g') {
          if (!line(text, length) || !pickle_scan::decimal(text, length, index)) return "a GET that is not a memo index";
        } else {
          const size_t width = op == 'h' ? 1 : 4;
          if (n - i < width) return "truncated";
          index = little_endian(p + i, width);
          i += width;
        }
        if (index >= memo) return "a memo slot read before it is written";
        break;
      }
      default:  // the extension registry, out-of-band buffers, or not an opcode
        return "an opcode outside the plain set";
    }
  }
  return "no STOP";
}

// Two plain pickles walked side by side (fsdpfast._native.pickle_value_changes): whether they are
// the same program of opcodes, memo slots and names, differing only in the values of numbers and
// strings (BININT1, BININT2, BININT, LONG1 of one byte length; BINUNICODE and SHORT_BINUNICODE of one
// length). Rank files of one checkpoint are (their mesh coordinates, hashes and a few shapes
// differ): planning reads the first fully and the others as these changes. `changes` gets the
// offset, in `a`, of each opcode whose value differs; false if the two differ in anything else,
// or if either is not plain.
inline bool pickle_value_changes(const unsigned char* a, size_t na, const unsigned char* b, size_t nb,
                                 std::vector<size_t>& changes) {
  using pickle_scan::little_endian;
  if (na != nb || pickle_not_plain(a, na) != nullptr) return false;  // b then walks as a does, or differs
  size_t i = 0;
  const size_t n = na;
  auto same = [&](size_t from, size_t to) { return std::memcmp(a + from, b + from, to - from) == 0; };
  while (i < n) {
    const size_t at = i;
    const unsigned char op = a[i++];
    if (b[at] != op) return false;
    size_t end = i;  // the end of this opcode's argument
    bool value = false;  // whether a difference in its argument is a value
    switch (op) {
      case '.':
        return true;
      case 'K': end = i + 1; value = true; break;
      case 'M': end = i + 2; value = true; break;
      case 'J': end = i + 4; value = true; break;
      case 0x8a: case 0x8c:  // LONG1, SHORT_BINUNICODE: one length byte, then the value
        if (a[i] != b[i]) return false;
        end = i + 1 + a[i];
        value = true;
        break;
      case 'X':  // BINUNICODE: four length bytes, then the value
        if (!same(i, i + 4)) return false;
        end = i + 4 + size_t(little_endian(a + i, 4));
        value = true;
        break;
      case 'U': case 'C': end = i + 1 + a[i]; break;
      case 'T': case 'B': case 0x8b: end = i + 4 + size_t(little_endian(a + i, 4)); break;
      case 0x8d: case 0x8e: case 0x96: end = i + 8 + size_t(little_endian(a + i, 8)); break;
      case 0x80: case 'q': case 'h': end = i + 1; break;
      case 'r': case 'j': end = i + 4; break;
      case 'G': case 0x95: end = i + 8; break;
      case 'F': case 'I': case 'L': case 'P': case 'S': case 'V': case 'p': case 'g':
        end = size_t(static_cast<const unsigned char*>(std::memchr(a + i, '\n', n - i)) - a) + 1;
        break;
      case 'c': case 'i': {
        const size_t first = size_t(static_cast<const unsigned char*>(std::memchr(a + i, '\n', n - i)) - a) + 1;
        end = size_t(static_cast<const unsigned char*>(std::memchr(a + first, '\n', n - first)) - a) + 1;
        break;
      }
      default:  // no argument (the scan above admitted every opcode)
        break;
    }
    if (!same(i, end)) {
      if (!value) return false;
      changes.push_back(at);
    }
    i = end;
  }
  return false;
}

}  // namespace fsdpfast
