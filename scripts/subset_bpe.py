"""GPT-2's byte-level BPE cut down to the pieces some texts use (stdlib only).

The offline RL recipe's model is tiny (64 wide), and with GPT-2's 50,257 tokens nearly all
of its cost is the LM head: warming it up on arithmetic took 13 minutes with that head and
takes seconds with this one. A cut vocabulary keeps GPT-2's pieces, so every text the
subset was made for tokenizes into exactly the pieces GPT-2 gives it, and any other text
still tokenizes (into smaller pieces, down to the 256 byte symbols, which are all kept).

Why the same pieces: every GPT-2 token is made by exactly one merge (50,000 merges, 256
byte symbols and <|endoftext|> make its 50,257 tokens). The subset keeps each piece the
texts end up in together with every piece their merges pass through, and the merges that
make those pieces, in GPT-2's order. On those texts BPE then takes the same merge at each
step as GPT-2 does: the merge GPT-2 takes is kept, and a kept merge of lower rank would
have been GPT-2's choice too.
"""

from __future__ import annotations

import re
from typing import Iterable

# GPT-2's pre-tokenizer, for ASCII text (its \p{L} and \p{N} are [A-Za-z] and [0-9] there).
_ASCII_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (openai/gpt-2 encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def pretokenize(text: str) -> list[str]:
    """`text`'s words as GPT-2 splits it, each in byte symbols. ASCII only: the regex above
    is GPT-2's on ASCII alone, so other text is refused rather than split differently."""
    if not text.isascii():
        raise ValueError(f"subset_bpe handles ASCII text only: {text!r}")
    symbols = bytes_to_unicode()
    return ["".join(symbols[b] for b in word.encode("ascii")) for word in _ASCII_PRETOKENIZE.findall(text)]


def merge_path(word: str, ranks: dict[tuple[str, str], int]) -> tuple[list[str], list[str]]:
    """BPE on one word: its final pieces and every piece a merge made on the way."""
    parts, made = list(word), []
    while len(parts) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        made.append(parts[i])
    return parts, made


def subset(vocab: dict[str, int], merges: list[tuple[str, str]], texts: Iterable[str],
           specials: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The cut vocabulary (ids 0..n-1, in GPT-2's id order) and its merges (in GPT-2's order):
    the 256 byte symbols, every piece `texts` are made of or pass through, and `specials`."""
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    keep = set(bytes_to_unicode().values()) | set(specials)
    for word in {word for text in texts for word in pretokenize(text)}:
        parts, made = merge_path(word, ranks)
        keep.update(parts, made)
    missing = sorted(piece for piece in keep if piece not in vocab)
    if missing:
        raise ValueError(f"pieces not in the vocabulary: {missing[:5]}")
    ordered = sorted(keep, key=vocab.__getitem__)
    return {piece: i for i, piece in enumerate(ordered)}, [pair for pair in merges if pair[0] + pair[1] in keep]
