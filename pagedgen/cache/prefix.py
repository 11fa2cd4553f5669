"""Automatic prefix caching: full blocks named by a hash chained over their tokens, reused by later requests.

A full block's K/V depend on every token before it and on its own tokens at their positions, so it is named
by a digest chained over the blocks before it (BLAKE2b, 16 bytes, the first block salted with the model's
identity): a block found under a name holds exactly what a new request would compute there, and since a
full block is never written again, sharing it needs no copy-on-write. :class:`PrefixCache` is the name
table (digest to block and back); the block pool keeps the blocks' states and reference counts, and the
manager keeps the two in step. Only purely paged models on the dynamic path use it (a window ring or a
fixed state cannot be restored at a block boundary). The rules: docs/cache.md, "Prefix caching".
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from pagedgen.errors import CacheError

DIGEST_BYTES = 16  # 128 bits: a collision (two different prefixes, one name) is not a practical concern


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """The digest of one full block: its parent's digest (``None`` for the first block, which takes
    ``salt`` instead) chained with its token ids (each as 4 little-endian bytes)."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(b"\x00" + salt if parent is None else b"\x01" + parent)
    for token in tokens:
        digest.update(operator.index(token).to_bytes(4, "little"))
    return digest.digest()


class BlockHashes:
    """The chained digests of the full blocks of one growing token sequence, computed once each, on demand.

    ``tokens`` is the request's own list (read, never written): tokens are only ever appended, so a full
    block's digest never changes once computed. Cost: one hash per block, the first time it is asked for.
    """

    __slots__ = ("tokens", "block_size", "salt", "_digests")

    def __init__(self, tokens: Sequence[int], block_size: int, salt: bytes = b""):
        self.tokens = tokens
        self.block_size = operator.index(block_size)
        self.salt = salt
        self._digests: list[bytes] = []

    @property
    def num_full_blocks(self) -> int:
        return len(self.tokens) // self.block_size

    def snapshot(self) -> tuple[int, bytes]:
        """What names the digests besides the tokens (the digests themselves are a memo of the tokens)."""
        return self.block_size, self.salt

    def upto(self, num_blocks: int) -> list[bytes]:
        """The digests of the first ``num_blocks`` blocks; ``CacheError`` if they are not all full."""
        if num_blocks > self.num_full_blocks:
            raise CacheError(
                f"block {num_blocks - 1} is not full: the sequence holds {len(self.tokens)} tokens in blocks "
                f"of {self.block_size}"
            )
        bs = self.block_size
        while len(self._digests) < num_blocks:
            i = len(self._digests)
            parent = self._digests[-1] if i else None
            self._digests.append(block_hash(parent, self.tokens[i * bs : (i + 1) * bs], self.salt))
        return self._digests[:num_blocks]

    def __getitem__(self, index: int) -> bytes:
        return self.upto(index + 1)[index]


@dataclass(slots=True)
class PrefixStats:
    """Admissions' prefix lookups, counted when their step commits (a rolled-back step counts nothing)."""

    queries: int = 0  # committed admissions that looked up their prefix
    queried_tokens: int = 0  # their sequence tokens
    hits: int = 0  # admissions that found at least one cached block
    hit_tokens: int = 0  # tokens served from the cache instead of computed


class PrefixCache:
    """The name table of published full blocks: ``digest -> block`` and ``block -> digest``, one to one.

    It decides nothing about block states (the pool does) and never mutates the pool; the manager calls
    :meth:`publish` at commit, :meth:`forget` when it evicts, :meth:`match` when it plans an admission.
    """

    __slots__ = ("_block_of", "_digest_of", "stats")

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block: object) -> bool:
        return block in self._digest_of

    def digest_of(self, block: int) -> bytes | None:
        return self._digest_of.get(block)

    def block_of(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def entries(self) -> dict[bytes, int]:
        """A copy of the table (for validators and tests)."""
        return dict(self._block_of)

    def blocks(self) -> frozenset[int]:
        return frozenset(self._digest_of)

    def match(self, hashes: BlockHashes, max_blocks: int) -> tuple[int, ...]:
        """The blocks of the longest cached prefix of ``hashes``' sequence, at most ``max_blocks`` of them:
        block ``i`` is found only if every block before it was (a chain stops at its first miss)."""
        found: list[int] = []
        for digest in hashes.upto(min(max_blocks, hashes.num_full_blocks)):
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return tuple(found)

    def publish(self, block: int, digest: bytes) -> bool:
        """Name ``block`` by ``digest``; False (and nothing changes) when the digest already names a block
        (another request computed the same prefix at the same time: the first one stays the cached copy)
        or the block already has a name."""
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

    def forget(self, block: int) -> bytes:
        """Drop ``block``'s name (it was evicted); returns the digest. ``CacheError`` if it has none."""
        digest = self._digest_of.pop(block, None)
        if digest is None:
            raise CacheError(f"block {block} is not in the prefix cache")
        del self._block_of[digest]
        return digest
