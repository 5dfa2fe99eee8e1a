"""Offline tokenizers for the demo models.

Real checkpoints ship their tokenizers; the demo models are built on a machine with no hub access, so their
CLIP (byte-level BPE) and T5 (unigram) tokenizers are made in memory from a byte-level alphabet (every
prompt tokenizes) plus whole-word entries for the words the demo scenes use, then saved beside the
weights like any other tokenizer.
"""

from __future__ import annotations

from functools import lru_cache

from transformers import CLIPTokenizer, T5TokenizerFast

# Words that get a single token each (shapes, colours and scene words of the demo data); anything else
# falls back to characters, so unknown prompts still tokenize.
DEMO_WORDS = (
    "a an the on of in and with moving left right up down background circle square triangle "
    "red orange yellow green cyan blue purple pink white black gray grey brown fox cat dog"
).split()


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """The 256 printable stand-ins for bytes used by byte-level BPE (as GPT-2 and CLIP define them)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def _bpe_merges(words: list[str]) -> list[tuple[str, str]]:
    """Merges learned as BPE learns them (most frequent adjacent pair first, ties in order of appearance)
    until every word is one symbol. Applying merges by rank then rebuilds each word whole; one chain per word
    does not (an earlier word's merge such as ``a n`` splits ``orange`` into ``or an g e``)."""
    symbols = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in symbols):
        counts: dict[tuple[str, str], int] = {}
        for s in symbols:
            for pair in zip(s, s[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        best = max(counts, key=counts.__getitem__)  # first of the most frequent, in order of appearance
        merges.append(best)
        for i, s in enumerate(symbols):
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and (s[j], s[j + 1]) == best:
                    out.append(s[j] + s[j + 1])
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            symbols[i] = out
    return merges


def build_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP tokenizer: byte-level alphabet + BPE merges that make every demo word one token."""
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for ch in _byte_alphabet():
        add(ch)
    for ch in _byte_alphabet():
        add(ch + "</w>")
    merges = _bpe_merges(list(dict.fromkeys(DEMO_WORDS)))
    for left, right in merges:
        add(left + right)
    add("<|startoftext|>")
    add("<|endoftext|>")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def build_t5_tokenizer(model_max_length: int = 512) -> T5TokenizerFast:
    """A T5 (unigram) tokenizer: special tokens, whole demo words, then single characters as fallback."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    seen = {p for p, _ in pieces}
    for word in DEMO_WORDS:
        piece = "▁" + word
        if piece not in seen:
            pieces.append((piece, -1.0))
            seen.add(piece)
    for ch in _byte_alphabet()[:256]:
        if ch not in seen and ch.strip():
            pieces.append((ch, -10.0))
            seen.add(ch)
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
