"""An LRU store of the token ids of prompt text already tokenized, so a prompt whose
leading text was seen before gets its leading token ids without tokenizing again.

The design of llm-d-kv-cache-manager's ``prefixstore`` ``LRUTokenStore`` (read, not
copied): the text is cut into fixed-size character blocks, each block keyed by a hash
chained over every block before it, and a block's entry holds the ids of the tokens that
*end* inside it (their character offsets, which a Hugging Face ``tokenizers`` encoding
carries). A lookup walks the prompt's blocks while their keys are present and returns the
ids gathered so far; the tokenizer is asked only when that covers less than
``minPrefixOverlapRatio`` of the prompt.

What is exact and what is not: the chained key makes a hit mean "the text up to the end of
this block is identical", so the ids returned are the ids the tokenizer produced for that
same text — except near the block where the two prompts part: a word (pre-tokenizer piece)
that straddles the boundary may be cut differently when what follows it differs. The
lookup therefore drops the last matched block's ids (a piece longer than a whole block,
which no whitespace-splitting tokenizer produces from prose, is the remaining inexact
case). Ids come back for the covered prefix only — a *partial* tokenization — which is
what prefix-cache lookups need (only whole leading blocks are matched), not a token count.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import xxhash

__all__ = ["PrefixLookup", "TokenPrefixStore"]

_end = itemgetter(1)


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    token_ids: list[int]
    """The ids of the tokens of ``text[:covered]``."""
    covered: int
    """Characters of the prompt those ids cover (a multiple of the block size)."""
    coverage: float
    """``covered / len(text)`` (1.0 for an empty text)."""
    token_end: int = 0
    """Where the last of those tokens ends (a character offset; 0 without ids): the
    rest of the prompt, ``text[token_end:]``, is what a tail tokenization encodes."""


class TokenPrefixStore:
    """Block-chained text → token ids, least recently used blocks evicted first."""

    def __init__(self, block_chars: int = 256, capacity: int = 500_000) -> None:
        if block_chars < 1 or capacity < 1:
            raise ValueError("block size and capacity must be positive")
        self.block_chars = block_chars
        self.capacity = capacity
        # block key -> the ids of the tokens that end in it, packed as uint32 (a
        # tokenizer's ids): ~4 bytes per token instead of ~40 for a tuple of ints
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def memory_bytes(self) -> int:
        """An estimate of the store's size: each block's packed ids and end offset plus
        ~150 bytes of bytes-object and ordered-dict overhead."""
        return sum(len(b) + 150 for b in self._blocks.values())

    def _keys(self, text: str, n: int, salt: int) -> list[int]:
        b = self.block_chars
        data = text.encode("utf-8", "surrogatepass")
        # Key on characters, hash the block's UTF-8 bytes chained with the previous key.
        out: list[int] = []
        h = salt
        if len(data) == len(text):  # ASCII: byte and character offsets agree
            for i in range(n):
                h = xxhash.xxh3_64_intdigest(data[i * b:(i + 1) * b], h)
                out.append(h)
        else:
            for i in range(n):
                h = xxhash.xxh3_64_intdigest(
                    text[i * b:(i + 1) * b].encode("utf-8", "surrogatepass"), h)
                out.append(h)
        return out

    def lookup(self, text: str, salt: int = 0) -> PrefixLookup:
        """The ids of the longest stored prefix of ``text``, less its last block.
        ``salt`` separates tokenizations of the same text that differ (special tokens
        added or not)."""
        n = len(text) // self.block_chars
        parts: list[bytes] = []
        blocks = self._blocks
        for key in self._keys(text, n, salt):
            entry = blocks.get(key)
            if entry is None:
                break
            blocks.move_to_end(key)
            parts.append(entry)
        matched = len(parts)
        ids: list[int] = []
        token_end = 0
        if matched:
            parts.pop()  # the parting block may be cut differently
            matched -= 1
        if matched:
            token_end = int.from_bytes(parts[-1][-4:], "little")
            packed = array("I")
            packed.frombytes(b"".join(p[:-4] for p in parts))
            ids = packed.tolist()
            self.hits += 1
        else:
            self.misses += 1
        covered = matched * self.block_chars
        return PrefixLookup(ids, covered, covered / len(text) if text else 1.0, token_end)

    def add(self, text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
            salt: int = 0, first_block: int = 0, shift: int = 0) -> None:
        """Record a tokenization of ``text``: ``ids[j]`` spans ``offsets[j]`` (character
        offsets into ``text``, end exclusive; special tokens the tokenizer adds span
        ``(0, 0)``). Only whole blocks are stored. ``first_block``: the tokens given are
        those ending in that block or later (a tail tokenization after a lookup); the
        blocks before it are left as they are. ``shift``: the offsets are relative to
        that character of ``text`` (a tail's own encoding)."""
        b = self.block_chars
        n = len(text) // b
        if n <= first_block:
            return
        # Token j belongs to the block its end offset falls in; the ends ascend, so each
        # block's tokens are one slice, found by bisection. Special tokens the tokenizer
        # adds span (0, 0): before the text they fall in block 0; after it (a trailing
        # EOS) they end the text and are left out. Each entry is the block's ids packed
        # as uint32 and, last, where its last token ends (the previous block's end when
        # none ends in it).
        if len(ids) != len(offsets):
            raise ValueError(f"{len(ids)} token ids for {len(offsets)} offsets")
        m = len(offsets)
        while m and offsets[m - 1][1] == 0:
            m -= 1
        if m == 0:  # no token spans text
            m = len(offsets)
        bounds = [bisect_right(offsets, (i + 1) * b - shift, 0, m, key=_end)
                  for i in range(first_block, n)]
        try:
            entries = [array("I", ids[lo:hi]).tobytes()
                       + (offsets[hi - 1][1] + shift if hi else shift).to_bytes(4, "little")
                       for lo, hi in zip([0, *bounds], bounds, strict=False)]
        except OverflowError:  # an id beyond 32 bits: no tokenizer's; not stored
            return
        blocks = self._blocks
        keys = self._keys(text, n, salt)[first_block:]
        for key, entry in zip(keys, entries, strict=True):
            blocks[key] = entry
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
