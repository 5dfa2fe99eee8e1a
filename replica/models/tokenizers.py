"""Offline tokenizers for the demo models.

Real checkpoints ship their tokenizers; the demo models are built on a machine with no hub access, so their
CLIP (byte-level BPE) and T5 (unigram) tokenizers are made in memory from a byte-level alphabet (every
prompt tokenizes) plus whole-word entries for the words the demo scenes use, then saved beside the
weights like any other tokenizer.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Regex, normalizers
from transformers import CLIPTokenizer, PreTrainedTokenizerFast, T5TokenizerFast

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


# -- how the scene models read a prompt ------------------------------------------------------------------

_COLOURS = "red|orange|yellow|green|cyan|blue|purple|pink|white|black|gray|brown"  # scenes.COLOURS
_MOTION_VERBS = "going|goes|moves|heading|headed|travelling|traveling|travels|drifting|drifts|sliding|slides"
# Phrasings of a direction, rewritten to the caption's one word (applied in this order: "from left to right"
# before "to right").
_DIRECTION_PHRASES = {
    "right": (r"from (?:the )?left to (?:the )?right", r"(?:to|towards?) the right", r"rightwards?"),
    "left": (r"from (?:the )?right to (?:the )?left", r"(?:to|towards?) the left", r"leftwards?"),
    "up": (r"from (?:the )?bottom to (?:the )?top", r"(?:to|towards?) the top", r"upwards?"),
    "down": (r"from (?:the )?top to (?:the )?bottom", r"(?:to|towards?) the bottom", r"downwards?"),
}


def _replace(pattern: str, content: str) -> normalizers.Normalizer:
    return normalizers.Replace(Regex(pattern), content)


def caption_normalizer() -> normalizers.Normalizer:
    """Rewrite a prompt into the wording the scene models were trained on, before tokenizing.

    Case, punctuation and spacing go ("A Red Circle on a Blue Background." reads as the caption); "an" reads
    as the captions' "a" ("an orange square"), "grey" as "gray"; "going", "moves", "heading", ... as
    "moving"; "to the left", "leftwards", "from right to left" as "left" (and so for right, up and down);
    "on blue background", "on the blue background", "against a blue background" as "on a blue background",
    and a prompt ending "on a blue" gets its "background". Words the models were not trained on pass
    through unchanged (the model draws its best guess; it is not an error). A caption as written in
    training is left as it is, so it tokenizes to the ids it was trained on.
    """
    steps = [
        normalizers.NFC(),
        normalizers.Lowercase(),
        _replace(r"[^\p{L}\p{N}\s]", " "),
        _replace(r"\s+", " "),
        normalizers.Strip(),
        _replace(r"\ban\b", "a"),
        _replace(r"\bgrey\b", "gray"),
        _replace(rf"\b(?:{_MOTION_VERBS})\b", "moving"),
    ]
    for direction, phrases in _DIRECTION_PHRASES.items():
        steps += [_replace(rf"\b{phrase}\b", direction) for phrase in phrases]
    steps += [
        _replace(rf"\b(?:against|over)\b(?= (?:a |the )?(?:{_COLOURS}) background\b)", "on"),
        _replace(rf"\bon (?:the )?(?=(?:{_COLOURS}) background\b)", "on a "),
    ]
    steps += [_replace(rf"\bon (?:a |the )?{c}$", f"on a {c} background") for c in _COLOURS.split("|")]
    return normalizers.Sequence(steps)


def with_caption_normalizer(tokenizer) -> PreTrainedTokenizerFast:
    """``tokenizer`` (a demo CLIP or T5 tokenizer) reading prompts through :func:`caption_normalizer`.

    Saved, it is a plain ``PreTrainedTokenizerFast``: transformers' CLIP and T5 tokenizer classes rebuild
    their normalizer on load and would drop this one, while the generic class loads ``tokenizer.json`` as it
    is, so diffusers' own pipelines read a prompt as ditserve does.
    """
    backend = tokenizer.backend_tokenizer
    backend.normalizer = caption_normalizer()
    special = {
        key: getattr(tokenizer, key)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, key, None) is not None
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=tokenizer.model_max_length, **special
    )


def name_tokenizers_generic(folder) -> None:
    """Name the tokenizers of a saved pipeline ``folder`` that :func:`with_caption_normalizer` made
    ``PreTrainedTokenizerFast`` in ``model_index.json`` and their ``tokenizer_config.json`` (transformers 5
    saves the class as ``TokenizersBackend``, a name transformers 4 lacks; both load the generic name)."""
    import json
    from pathlib import Path

    folder = Path(folder)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, entry in index.items():
        config_path = folder / name / "tokenizer_config.json"
        if not (isinstance(entry, list) and config_path.is_file()):
            continue
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            index[name] = ["transformers", "PreTrainedTokenizerFast"]
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
