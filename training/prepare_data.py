"""Build the story corpus, its tokenizer and the token arrays the trainer reads.

Data choice: the cased file (1,091 stories) plus a recased version of the part of the lowercase
file that the cased file does not cover (about 4,380 more stories): four times the text, which
matters more than a residual casing error for a model that sees the corpus many times. The
recaser (`training/text.py`) learns from the cased stories; learned on 80% of them and applied
to the lowercased other 20%, it restores 99.5% of the words exactly, 97.9% of the capitalised
ones, with 99.2% precision (the run prints these figures; `--cased-only` skips the lowercase file).

Stories are de-duplicated and every `--val-every`-th one (2.5% by default, deterministic) is held
out. The tokenizer is a byte-level BPE trained on the training stories, with the MiniMax-M3
special-token strings appended as special tokens after the learned ids (as the release places
them at the end of its vocabulary) and the M3-style chat template. Every story is stored as
`]~!b[` + text + `[e~[`, so generation from the BOS writes a story and stops at the EOS.

Output (`--out DIR`): tokenizer/ (tokenizer.json, tokenizer_config.json, special_tokens_map.json),
train.npy and val.npy (uint16 token streams), meta.json.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from training.text import Recaser, repair, split_stories

REPO = Path(__file__).resolve().parents[1]
BOS, TURN, EOS = "]~!b[", "]~b]", "[e~["
# The MiniMax-M3 special tokens, in the order of the release's ids (BOS, turn start, EOS, ...).
SPECIAL_TOKENS = (BOS, TURN, EOS, "<mm:think>", "</mm:think>", "]<]minimax[>[", "<tool_call>",
                  "</tool_call>", "<think>", "</think>", "]<]image[>[", "]<]video[>[")  # fmt: skip
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def default_data_dir() -> Path:
    """../shared/data next to the repository, or shared/data inside it."""
    outside = REPO.parent / "shared" / "data"
    return outside if outside.is_dir() else REPO / "shared" / "data"


def load_stories(data_dir: Path, cased_only: bool, limit: int | None) -> tuple[list[str], dict]:
    """Cased stories, then the recased lowercase stories the cased file lacks; plus recasing figures."""
    all_cased = split_stories(repair((data_dir / "tinystories-cased.txt").read_text(encoding="utf-8")))
    cased = all_cased[:limit]
    stats: dict = {"cased_stories": len(cased)}
    if cased_only:
        return cased, stats
    lower = split_stories(repair((data_dir / "tinystories-lower.txt").read_text(encoding="utf-8")))
    seen = {s.lower() for s in all_cased}  # the lowercase file starts with the cased stories
    extra = [s for s in lower if s not in seen][:limit]
    stats.update(recasing_accuracy(cased))
    recase = Recaser.learn(cased)
    stats["recased_stories"] = len(extra)
    return cased + [recase(s) for s in extra], stats


def recasing_accuracy(cased: list[str], train_frac: float = 0.8) -> dict:
    """Learn on the first stories, recase the lowercased rest, compare words with the originals."""
    cut = max(1, int(len(cased) * train_frac))
    recase = Recaser.learn(cased[:cut])
    total = same = caps = caps_same = predicted = predicted_same = 0
    for story in cased[cut:]:
        truth = re.findall(r"[A-Za-z]+", story)
        guess = re.findall(r"[A-Za-z]+", recase(story.lower()))
        for t, g in zip(truth, guess, strict=True):
            total += 1
            same += t == g
            caps += t[0].isupper()
            caps_same += t[0].isupper() and t == g
            predicted += g[0].isupper()
            predicted_same += g[0].isupper() and t == g
    return {
        "recase_word_accuracy": same / max(1, total),
        "recase_capitalised_recall": caps_same / max(1, caps),
        "recase_capitalised_precision": predicted_same / max(1, predicted),
    }


def train_tokenizer(stories: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the stories, then the special tokens at the end of the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json plus the transformers configs (the M3-style chat template, no auto BOS/EOS)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                  "normalized": False, "single_word": False}
        for s in SPECIAL_TOKENS
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,  # the chat template and the story format write their own BOS
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": decoder,
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n"
    )


def encode_stories(tok: Tokenizer, stories: list[str]) -> np.ndarray:
    """One uint16 stream: BOS + story + EOS for every story."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts = [np.array([bos, *e.ids, eos], dtype=np.uint16) for e in tok.encode_batch(stories)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=default_data_dir())
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=4096, help="ids in all, special tokens included")
    p.add_argument("--val-every", type=int, default=40, help="every N-th story goes to validation")
    p.add_argument("--cased-only", action="store_true", help="skip the recased lowercase file")
    p.add_argument("--limit", type=int, default=None, help="first N stories of each file (tests)")
    a = p.parse_args(argv)
    if not (a.data_dir / "tinystories-cased.txt").is_file():
        p.error(f"no tinystories-cased.txt in {a.data_dir}; pass --data-dir")
    start = time.perf_counter()

    stories, stats = load_stories(a.data_dir, a.cased_only, a.limit)
    stories = list(dict.fromkeys(stories))  # exact duplicates would leak into validation
    val = stories[a.val_every - 1 :: a.val_every]
    train = [s for i, s in enumerate(stories) if (i + 1) % a.val_every]
    tok = train_tokenizer(train, a.vocab_size)
    save_tokenizer(tok, a.out / "tokenizer")
    train_ids, val_ids = encode_stories(tok, train), encode_stories(tok, val)
    assert tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1
    np.save(a.out / "train.npy", train_ids)
    np.save(a.out / "val.npy", val_ids)
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "train_stories": len(train),
        "val_stories": len(val),
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "chars_per_token": sum(map(len, train)) / max(1, train_ids.size - 2 * len(train)),
        **stats,
    }
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))
    print(f"prepared {a.out} in {time.perf_counter() - start:.1f} s")
    return meta


if __name__ == "__main__":
    main()
