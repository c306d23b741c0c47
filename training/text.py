"""Corpus text clean-up: mojibake repair, story splitting and recasing of the lowercase file.

The TinyStories dump was written as UTF-8, read back as Windows-1252 and written again, so every
non-ASCII character became two or three characters (`’` -> `â€™`). The lowercase file was
lowercased after that, which also turned the lead `Â`/`Ã` of two-byte sequences into `â`/`ã`.
`repair` reverses both, then folds typographic punctuation to the ASCII the rest of the corpus
uses, so one quote style reaches the tokenizer.

Recasing learns from the cased file how TinyStories capitalises: which words are capitalised in
mid-sentence (names, "I", "TV"), and, per word, whether it is capitalised right after a closed
quotation (`"Hi!" said Tom` keeps "said" lowercase, `"Stop." Then` does not). Sentence and
paragraph starts and the first word inside an opening quote are capitalised, and a word right
after "named" is taken as a name for the rest of its story.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

# Windows-1252 renders bytes 0x80..0xBF (UTF-8 continuation bytes) as these characters; bytes it
# leaves undefined (0x81, 0x8D, 0x8F, 0x90, 0x9D) were dropped when the text was written.
_CONT = {bytes([b]).decode("cp1252", errors="ignore"): b for b in range(0x80, 0xC0)}
_CONT.pop("", None)
_LEADS = {"â": (0xE2, 0xC2), "ã": (0xE3, 0xC3), "Â": (0xC2,), "Ã": (0xC3,)}
_MOJIBAKE = re.compile("[âãÂÃ][" + re.escape("".join(_CONT)) + "]+")
_ASCII_PUNCT = str.maketrans({"“": '"', "”": '"', "„": '"', "«": '"', "»": '"', "‘": "'", "’": "'",
                              "‚": "'", "–": "-", "…": "...", "\u00a0": " "})  # fmt: skip
_EM_DASH = re.compile(r"\s*—\s*")


def _unmangle(run: str) -> str:
    """One mojibake run back to its characters; unchanged when no reading decodes."""
    cont = bytes(_CONT[c] for c in run[1:])
    for lead in _LEADS[run[0]]:
        need = 2 if lead >= 0xE0 else 1
        body = cont[:need]
        if lead == 0xE2 and len(body) == 1 and body[0] == 0x80:
            body += b"\x9d"  # `â€` alone: the dropped 0x9D of a closing quote
        if len(body) != need:
            continue
        try:
            return (bytes([lead]) + body).decode("utf-8") + run[1 + need :]
        except UnicodeDecodeError:
            continue
    return run


def repair(text: str) -> str:
    """Undo the double encoding, then fold quotes, dashes and ellipses to ASCII."""
    text = _MOJIBAKE.sub(lambda m: _unmangle(m.group(0)), text)
    text = _EM_DASH.sub(" - ", text.translate(_ASCII_PUNCT))
    return text


def split_stories(text: str) -> list[str]:
    """Stories of a dump: paragraphs are separated by blank lines, stories by a single newline.

    A line that follows a non-blank line and does not start with a space opens a new story (the
    dataset's end-of-text markers were dropped, leaving one newline). Within a story, paragraph
    breaks are normalised to one blank line and surrounding spaces are stripped.
    """
    stories: list[list[str]] = []
    prev_blank = True
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            prev_blank = True
            continue
        if stories and (prev_blank or raw[:1].isspace()):
            stories[-1].append(line)
        else:
            stories.append([line])
        prev_blank = False
    return ["\n\n".join(paragraphs) for paragraphs in stories]


_WORD = re.compile(r"[A-Za-z]+")
_SENTENCE_END = re.compile(r"[.!?]")
_CLAUSE_END = re.compile(r"[.!?,]")
START, OPEN_QUOTE, AFTER_QUOTE, MID = "start", "open_quote", "after_quote", "mid"


def word_contexts(text: str) -> list[tuple[int, int, str]]:
    """(start, end, context) of every word.

    Contexts: START (paragraph or sentence start), OPEN_QUOTE (first word inside a quotation),
    AFTER_QUOTE (first word after a quotation that ends with punctuation, where TinyStories writes
    both `"Hi!" said Tom` and `"Stop." Then`) and MID (anywhere else).
    """
    out = []
    prev_end, quotes = 0, 0  # double quotes so far in the paragraph: odd means inside a quotation
    for m in _WORD.finditer(text):
        gap = text[prev_end : m.start()]
        prev_end = m.end()
        new_paragraph = not out or "\n" in gap
        if "\n" in gap:
            gap, quotes = gap.rsplit("\n", 1)[1], 0
        quotes += gap.count('"')
        if gap.rstrip().endswith('"') and quotes % 2 == 1:
            context = OPEN_QUOTE
        elif new_paragraph:
            context = START
        elif '"' in gap:
            context = AFTER_QUOTE if _CLAUSE_END.search(gap) else MID
        elif _SENTENCE_END.search(gap):
            context = START
        else:
            context = MID
        out.append((m.start(), m.end(), context))
    return out


@dataclass
class Recaser:
    """Casing learned from cased text: mid-sentence forms and per-context capitalisation."""

    forms: dict[str, str]  # lowercase word -> its usual mid-sentence form, when that is not lowercase
    capitalise: dict[tuple[str, str], bool]  # (context, word) -> capitalised at that context
    default: dict[str, bool]  # context -> decision for a word never seen there
    common_lower: frozenset[str]  # words mostly lowercase mid-sentence (not names even after "named")

    @classmethod
    def learn(cls, cased: Iterable[str], min_count: int = 2) -> Recaser:
        mid: dict[str, Counter] = defaultdict(Counter)
        ctx: dict[tuple[str, str], Counter] = defaultdict(Counter)
        for text in cased:
            for start, end, context in word_contexts(text):
                word = text[start:end]
                if context == MID:
                    mid[word.lower()][word] += 1
                else:
                    ctx[(context, word.lower())][word[0].isupper()] += 1
        forms = {}
        for w, c in mid.items():
            form, n = c.most_common(1)[0]
            if form != w and n >= min_count and 2 * n > sum(c.values()):
                forms[w] = form
        capitalise = {key: c[True] > c[False] for key, c in ctx.items()}
        by_context: dict[str, Counter] = defaultdict(Counter)
        for (context, _), cap in capitalise.items():
            by_context[context][cap] += 1  # a majority over word types: unseen words are rare words
        default = {context: c[True] >= c[False] for context, c in by_context.items()}
        common_lower = frozenset(
            w for w, c in mid.items() if 2 * c[w] > sum(c.values()) and c[w] >= min_count
        )
        return cls(forms, capitalise, default, common_lower)

    def __call__(self, text: str) -> str:
        """Recase one lowercase story."""
        words = [(start, end, text[start:end], context) for start, end, context in word_contexts(text)]
        after_named = {i + 1 for i, w in enumerate(words[:-1]) if w[2] == "named"}
        # A word after "named" is a name for the whole story unless it is a common word ("lucky").
        names = {words[i][2] for i in after_named if words[i][2] not in self.common_lower}
        out, last = [], 0
        for i, (start, end, word, context) in enumerate(words):
            if word in self.forms:
                new = self.forms[word]
            elif self._capitalised(word, context) or word in names or i in after_named:
                new = word.capitalize()
            else:
                new = word
            out += [text[last:start], new]
            last = end
        out.append(text[last:])
        return "".join(out)

    def _capitalised(self, word: str, context: str) -> bool:
        if context == MID:
            return False
        return self.capitalise.get((context, word), self.default.get(context, True))
