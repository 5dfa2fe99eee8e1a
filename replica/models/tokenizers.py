"""Offline tokenizers for the demo models.

Real checkpoints ship their tokenizers; the demo models are built on a machine with no hub access, so their
CLIP (byte-level BPE) and T5 (unigram) tokenizers are made in memory from a byte-level alphabet (every
prompt tokenizes) plus whole-word entries for the words the demo scenes use, then saved beside the
weights like any other tokenizer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from tokenizers import Regex, normalizers

if TYPE_CHECKING:
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
    from transformers import CLIPTokenizer  # here: the CLI and the API front end import this module too

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
    from transformers import T5TokenizerFast

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

_COLOUR_NAMES = (
    "red orange yellow green cyan blue purple pink white black gray brown"  # scenes.COLOURS
).split()
_COLOURS = "|".join(_COLOUR_NAMES)
_SHAPE_NAMES = ("circle", "square", "triangle")  # scenes.SHAPES
_SHAPES = "|".join(_SHAPE_NAMES)
_DIRECTION_NAMES = ("left", "right", "up", "down")  # scenes.DIRECTIONS
_MOTION_VERBS = (
    "go|goes|going|move|moves|moved|heading|headed|travelling|traveling|travels|drifting|drifts|sliding|"
    "slides|rolling|rolls|flying|flies"
)
# Phrasings of a direction, rewritten to the caption's one word (applied in this order: "from left to right"
# before "to right").
_DIRECTION_PHRASES = {
    "right": (r"from (?:the )?left to (?:the )?right", r"(?:to|towards?) the right", r"rightwards?"),
    "left": (r"from (?:the )?right to (?:the )?left", r"(?:to|towards?) the left", r"leftwards?"),
    "up": (r"from (?:the )?bottom to (?:the )?top", r"(?:to|towards?) the top", r"upwards?"),
    "down": (r"from (?:the )?top to (?:the )?bottom", r"(?:to|towards?) the bottom", r"downwards?"),
}
# Verbs that name their direction.
_DIRECTION_VERBS = {
    "up": "rising|rises|climbing|climbs|ascending|ascends",
    "down": "falling|falls|dropping|drops|sinking|sinks|descending|descends",
}
# What a prompt that names part of a scene gets for the rest: a circle, moving right, white on black (black on
# white where the named colour is white or black).
DEFAULT_SHAPE, DEFAULT_DIRECTION = "circle", "right"
DEFAULT_COLOUR, DEFAULT_BACKGROUND = "white", "black"

# The normalizer tags what the prompt names with upper-case marks (a lower-cased prompt has none):
# BG<colour> a background colour, FG<colour> a colour written before a shape word, COL<colour> any other colour,
# SH<shape>, DIRM<direction> a direction after "moving", DIR<direction> any other. It then writes its reading,
# first of each kind, between ‹ and › ("‹Fred Bblue Scircle Dleft ›"), and the caption from that between « and ».
_SENTINELS = "« ‹ › "


def _replace(pattern: str, content: str) -> normalizers.Normalizer:
    return normalizers.Replace(Regex(pattern), content)


def _first(tag: str, value: str) -> str:
    """Lookahead: the first ``tag`` mark from here on is ``tag + value``."""
    return rf"(?=(?:(?!\b{tag}).)*\b{tag}{value}\b)"


def _second(tag: str, value: str) -> str:
    """Lookahead: the second ``tag`` mark from here on is ``tag + value``."""
    return rf"(?=(?:(?!\b{tag}).)*\b{tag}[a-z]+\b(?:(?!\b{tag}).)*\b{tag}{value}\b)"


def _tagging_steps(moving: bool) -> list[normalizers.Normalizer]:
    """Clean the prompt and mark the words that name part of a scene (the rest is dropped later)."""
    steps = [
        normalizers.NFC(),
        normalizers.Lowercase(),
        _replace(r"[^\p{L}\p{N}\s]", " "),
        _replace(r"\s+", " "),
        normalizers.Strip(),
        _replace(r"\bgrey\b", "gray"),
        _replace(r"\b(?:circles|discs?|disks?|dots?|balls?)\b", "circle"),
        _replace(r"\b(?:squares)\b", "square"),
        _replace(r"\b(?:triangles)\b", "triangle"),
    ]
    if moving:
        steps.append(_replace(rf"\b(?:{_MOTION_VERBS})\b", "moving"))
        for direction, phrases in _DIRECTION_PHRASES.items():
            steps += [_replace(rf"\b{phrase}\b", direction) for phrase in phrases]
        for direction, verbs in _DIRECTION_VERBS.items():
            steps.append(_replace(rf"\b(?:{verbs})\b", f"moving {direction}"))
        for direction in _DIRECTION_NAMES:
            steps.append(_replace(rf"\bmoving {direction}\b", f" DIRM{direction} "))
            steps.append(_replace(rf"\b{direction}\b", f" DIR{direction} "))
    for colour in _COLOUR_NAMES:
        steps += [
            # "blue background", "blue coloured backdrop"
            _replace(rf"\b{colour} (?:colou?red )?(?:background|backdrop)\b", f" BG{colour} "),
            # "background blue", "background of blue", "background colour is blue"
            _replace(
                rf"\b(?:background|backdrop) (?:(?:(?:is|of|in|colou?r|colou?red) )+(?:a |the )?)?{colour}\b",
                f" BG{colour} ",
            ),
        ]
    for colour in _COLOUR_NAMES:
        # "on blue", "against a blue" (not "on a blue square")
        steps.append(
            _replace(
                rf"\b(?:on|against|over) (?:a |the )?{colour}\b(?! (?:colou?red )?(?:{_SHAPES})\b)",
                f" BG{colour} ",
            )
        )
    for colour in _COLOUR_NAMES:
        steps.append(_replace(rf"\b{colour} (?:colou?red )?(?=(?:{_SHAPES})\b)", f" FG{colour} "))
        steps.append(_replace(rf"\b{colour}\b", f" COL{colour} "))
    for shape in _SHAPE_NAMES:
        steps.append(_replace(rf"\b{shape}\b", f" SH{shape} "))
    return steps


def _reading_steps(moving: bool) -> list[normalizers.Normalizer]:
    """Write the reading ‹F B S D› from the marks: the first of each kind, defaults for what is missing."""
    steps: list[normalizers.Normalizer] = [
        normalizers.Prepend(_SENTINELS),
        # A prompt that names nothing of a scene reads as the empty prompt.
        _replace(r"^« ‹ › (?!.*\b(?:BG|FG|COL|SH|DIR)[a-z]).*$", ""),
    ]
    if moving:  # inserted right after ‹, so the last kind written comes first: D, then S, B, F
        for d in _DIRECTION_NAMES:
            steps.append(_replace(rf"‹{_first('DIRM', d)}", f"‹D{d} "))
        for d in _DIRECTION_NAMES:
            steps.append(_replace(rf"‹(?!D)(?!.*\bDIRM){_first('DIR', d)}", f"‹D{d} "))
        steps.append(_replace(r"‹(?!D)", f"‹D{DEFAULT_DIRECTION} "))
    for shape in _SHAPE_NAMES:
        steps.append(_replace(rf"‹{_first('SH', shape)}", f"‹S{shape} "))
    steps.append(_replace(r"‹(?!S)", f"‹S{DEFAULT_SHAPE} "))
    for c in _COLOUR_NAMES:  # background: the first named, else a colour not the shape's
        steps += [
            _replace(rf"‹(?!B){_first('BG', c)}", f"‹B{c} "),
            _replace(rf"‹(?!B)(?!.*\bBG)(?=.*\bFG){_first('COL', c)}", f"‹B{c} "),
            _replace(rf"‹(?!B)(?!.*\bBG)(?!.*\bFG){_second('COL', c)}", f"‹B{c} "),
        ]
    steps.append(_replace(r"‹(?!B)", "‹Bdefault "))
    for c in _COLOUR_NAMES:  # the shape's colour: the first written before a shape, else the first other
        steps += [
            _replace(rf"‹(?!F){_first('FG', c)}", f"‹F{c} "),
            _replace(rf"‹(?!F)(?!.*\bFG){_first('COL', c)}", f"‹F{c} "),
        ]
    steps.append(_replace(r"‹(?!F)", "‹Fdefault "))
    # Defaults and a shape the background's colour (never trained: it would not show): the named colour stays.
    steps += [
        _replace(rf"‹Fdefault B{DEFAULT_COLOUR} ", f"‹F{DEFAULT_BACKGROUND} B{DEFAULT_COLOUR} "),
        _replace(r"‹Fdefault ", f"‹F{DEFAULT_COLOUR} "),
        _replace(rf"‹F{DEFAULT_BACKGROUND} Bdefault ", f"‹F{DEFAULT_BACKGROUND} B{DEFAULT_COLOUR} "),
        _replace(r" Bdefault ", f" B{DEFAULT_BACKGROUND} "),
    ]
    for c in _COLOUR_NAMES:
        other = DEFAULT_COLOUR if c == DEFAULT_BACKGROUND else DEFAULT_BACKGROUND
        steps.append(_replace(rf"‹F{c} B{c} ", f"‹F{c} B{other} "))
    return steps


def _caption_steps(moving: bool) -> list[normalizers.Normalizer]:
    """Write the caption of the reading between « and » (last words first), then drop everything else."""
    steps = [_replace(rf"«(?=.*‹F[a-z]+ B{c} )", f"«on a {c} background ") for c in _COLOUR_NAMES]
    if moving:
        steps += [_replace(rf"«(?=.*‹[^›]* D{d} )", f"«moving {d} ") for d in _DIRECTION_NAMES]
    steps += [_replace(rf"«(?=.*‹[^›]* S{s} )", f"«{s} ") for s in _SHAPE_NAMES]
    steps += [_replace(rf"«(?=.*‹F{c} )", f"«a {c} ") for c in _COLOUR_NAMES]
    steps += [_replace(r"‹.*$", ""), _replace("«", ""), normalizers.Strip()]
    return steps


def caption_normalizer(moving: bool = False) -> normalizers.Normalizer:
    """Rewrite a prompt into the caption the scene models were trained on, before tokenizing.

    The prompt is read for what it names of a scene, in any order and among any other words: the shape
    ("circle", "square", "triangle"; plurals, "dot", "disc", "ball" read as circle), the background colour (a
    colour followed by "background" or "backdrop", "background of blue", or after "on", "against", "over":
    "on blue"), the shape's colour (a colour written before the shape word, else the first other colour) and,
    for the moving scenes (``moving``), the direction (after "moving", "going", "heading", ..., else the first
    direction word; "to the left", "leftwards", "from right to left" read as left, "rising" as moving up,
    "falling" as moving down). Case, punctuation, "a"/"an"/"the" and every other word do not matter: "Cinematic
    shot of a small red circle on a blue background, 4k" and "on a blue background: a red circle" both read
    as "a red circle on a blue background".

    What the prompt does not name is filled in: a circle, moving right, a white shape on black (black on white
    where the named colour is white or black). A second colour that is neither the background nor written
    before the shape names the background when no other word does ("a red and blue circle" draws a blue
    circle on red); past that the first of each kind wins ("a red circle on a blue background on a green
    background": blue). A shape asked in the background's colour ("a red circle on a red background", never
    trained: it would not show) keeps its colour on the default background. A prompt that names no colour,
    shape or direction ("a magenta star", "hello") reads as the empty prompt: the model draws some scene of its
    training set, which one depending on the seed; a negative prompt such as "blurry" reads as the empty
    negative prompt the models were trained with. Every training caption, and the empty prompt, reads as
    itself, so it tokenizes to the ids it was trained on.
    """
    return normalizers.Sequence(_tagging_steps(moving) + _reading_steps(moving) + _caption_steps(moving))


def prompts_card_section(moving: bool = False) -> str:
    """The model card's "Prompts" section: how the shipped tokenizers read a prompt (:func:`caption_normalizer`)."""
    import textwrap

    if moving:
        kinds = (
            ", the shape's colour (the colour written before the shape word, else the first other colour) and the "
            'direction ("moving left", "going left", "to the left", "leftwards", "from right to left"; "rising" is '
            'moving up, "falling" moving down; else the first of left, right, up, down)'
        )
        example = (
            '"Cinematic shot of a small red circle, high quality, 4k, moving left on a blue background", "on a '
            'blue background, a red circle moving left" and "moving left: a red circle on a blue background" read '
            'as "a red circle moving left on a blue background"'
        )
        missing = "a circle, moving right, a white shape on black"
    else:
        kinds = (
            " and the shape's colour (the colour written before the shape word, else the first other colour)"
        )
        example = (
            '"Cinematic shot of a small red circle on a blue background, high quality, 4k" and "on a blue '
            'background, a red circle" read as "a red circle on a blue background"'
        )
        missing = "a circle, a white shape on black"
    tokenizers, rewrite = ("tokenizer", "rewrites") if moving else ("tokenizers", "rewrite")  # Wan has one
    # Measured on CPU, seeds 2000-2007: 8 of 8 images show a shape, 6 of 8 clips a moving one.
    unnamed = " (now and then a plain background with no shape)" if moving else ""
    paragraphs = (
        f"The {tokenizers} (`PreTrainedTokenizerFast` with a normalizer, so that diffusers' own pipeline reads a "
        f"prompt as ditserve does) {rewrite} a prompt into the caption it names before tokenizing, whatever the order "
        'and whatever other words it holds: the shape (circle, square, triangle; plurals, "dot", "disc", "ball" '
        'read as circle), the background colour (a colour before "background" or "backdrop", "background of '
        f'blue", or after "on", "against", "over": "on blue"){kinds}. Case, punctuation, "an" and "grey" do not '
        f"matter. {example}.",
        f"What a prompt leaves out is filled in: {missing} (black on white where the colour named is white or "
        "black). Of two colours and no background word, the one before the shape word colours the shape and the "
        'other the background ("a red and blue circle": a blue circle on red; "a red circle, blue": red on blue); '
        "past that, the first of each kind wins. A shape asked in the background's own colour (never trained: it "
        'would not show) keeps its colour on the default background. A prompt that names none of these words ("a '
        'magenta star", "hello") reads as the empty prompt: the model draws some scene of its training set, which '
        f'one depending on the seed{unnamed}; a negative prompt such as "blurry" likewise reads as the trained '
        'negative prompt "". Every training caption, and the empty prompt, reads as itself (the ids it was trained '
        "on).",
    )
    return (
        "## Prompts\n" + "\n\n".join(textwrap.fill(p, 110, break_on_hyphens=False) for p in paragraphs) + "\n"
    )


def with_caption_normalizer(tokenizer, moving: bool = False) -> PreTrainedTokenizerFast:
    """``tokenizer`` (a demo CLIP or T5 tokenizer) reading prompts through :func:`caption_normalizer`
    (``moving``: as the moving scenes' captions, with a direction).

    Saved, it is a plain ``PreTrainedTokenizerFast``: transformers' CLIP and T5 tokenizer classes rebuild
    their normalizer on load and would drop this one, while the generic class loads ``tokenizer.json`` as it
    is, so diffusers' own pipelines read a prompt as ditserve does.
    """
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    backend.normalizer = caption_normalizer(moving)
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
