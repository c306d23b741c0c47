"""The tokenizer: loading, encoding, chat prompts (streamed text is `m3lm.text`'s).

Special-token strings typed in text: `Tokenizer.encode` parses them as special tokens, as other
servers do for raw completion prompts, whose author writes the template markers by hand.
`Tokenizer.apply_chat_template` encodes them as plain text when they come from messages, tools or
template arguments, so only the markers the template writes itself become special tokens: a tool
result or a pasted document cannot forge a turn boundary.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from m3lm.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a local checkpoint directory, or None when the directory ships no tokenizer files."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # imported here so that `import m3lm` stays fast
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings concern config.json fields a tokenizer never uses
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # corrupt files surface as JSON, tokenizers, OS and value errors alike
        raise CheckpointError(f"cannot load the tokenizer in {path}: {_one_line(e)}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    return Tokenizer(hf, _generation_eos_ids(path / "generation_config.json"))


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _generation_eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list of ints), which may add stop ids."""
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"cannot read {path}: {_one_line(e)}") from e
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids


# Pre-tokenizers that never drop input characters: with them no token covers more characters than
# its own string has, so a text of C characters needs at least C / (longest token string) tokens.
_KEEPING_PRETOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})
# Below this share of the bound a conversation is not rendered twice to check its length: a chat
# template repeats no part of a conversation this many times.
_TEMPLATE_GROWTH = 8


class Tokenizer:
    """A loaded tokenizer with the few operations generation needs; token ids are plain lists of ints.

    Safe to share between threads (the server encodes while the engine decodes): the underlying
    tokenizer switches per-call state while encoding, so encoding holds a lock, and decoding uses
    its own copy of the tokenizer, so a long encode never holds up the text of running requests.
    """

    def __init__(self, hf: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = hf
        # The engine bounds prompts by max_model_len with a clear error; transformers' own bound
        # only adds a warning about indexing errors before it.
        hf.model_max_length = sys.maxsize
        self.bos_token_id: int | None = hf.bos_token_id
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(extra_eos_ids))
        self.vocab_size: int = len(hf)  # ids the tokenizer knows; the model may pad its embedding beyond this
        self.has_chat_template: bool = bool(hf.chat_template)
        # transformers lists only the named special tokens (bos, eos, ...), but decoding with
        # skip_special_tokens drops every added token flagged special, such as <mm:think>.
        flagged = {i for i, t in hf.added_tokens_decoder.items() if t.special}
        self.all_special_ids: frozenset[int] = frozenset(hf.all_special_ids) | flagged
        # Template arguments that would override apply_chat_template's own parameters are refused.
        params = inspect.signature(hf.apply_chat_template).parameters
        self._reserved = frozenset(params) - {"kwargs"} | {"messages"}
        self._lock = threading.RLock()
        backend = getattr(hf, "backend_tokenizer", None)
        self._decoder, self._decode_lock = _decoder_copy(backend), threading.Lock()
        self.max_token_chars: int | None = _max_token_chars(hf, backend)
        self._normalizer = backend.normalizer if backend is not None else None
        # Added tokens, written as text, that the template could be made to emit as tokens.
        control = sorted((t.content for t in hf.added_tokens_decoder.values() if t.content.strip()), key=len)
        self._control = re.compile("|".join(re.escape(t) for t in reversed(control))) if control else None

    def info(self, max_model_len: int) -> dict[str, Any]:
        """What a client needs to tokenize like the server: the special tokens, the class, the
        chat template and the context length (the server's `/tokenizer_info`)."""
        hf = self.hf
        return {
            "tokenizer_class": type(hf).__name__,
            "eos_token": hf.eos_token,
            "bos_token": hf.bos_token,
            "pad_token": hf.pad_token,
            "unk_token": hf.unk_token,
            "eos_token_ids": sorted(self.eos_token_ids),
            "vocab_size": self.vocab_size,
            "model_max_length": max_model_len,
            "chat_template": hf.chat_template if isinstance(hf.chat_template, str) else None,
        }

    def check_fits(self, text: str, max_tokens: int) -> None:
        """Raise ValueError when `text` certainly encodes to more than `max_tokens` tokens, without
        encoding it (a bound from its length); texts that might fit pass."""
        per = self.max_token_chars
        if per is None or len(text) <= max_tokens * per:
            return
        n = len(self._normalizer.normalize_str(text)) if self._normalizer is not None else len(text)
        if n > max_tokens * per:
            raise ValueError(
                f"the prompt ({len(text)} characters) exceeds the maximum context length: it cannot "
                f"fit in {max_tokens} tokens (no token of this tokenizer spans more than {per} characters)"
            )

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, adding no BOS/EOS: prompts from the chat template already carry their own BOS.

        parse_special=False encodes special-token strings as ordinary text.
        """
        with self._lock:
            return list(
                self.hf.encode(text, add_special_tokens=False, split_special_tokens=not parse_special)
            )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`, without the space clean-up that would make streamed and whole decodes differ."""
        if self._decoder is not None:
            with self._decode_lock:
                return self._decoder.decode(list(ids), skip_special_tokens=skip_special_tokens)
        with self._lock:
            return self.hf.decode(
                list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a conversation; template_kwargs (thinking_mode="enabled", ...) reach the template.

        The rendered text is tokenized without adding special tokens, so the template's own BOS is the
        only one. Bad messages or arguments raise ValueError.
        """
        return self.chat_prompt(messages, tools, add_generation_prompt, template_kwargs)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """`apply_chat_template` with the template's arguments as one mapping (a client's names never
        clash with the parameters) and, with `max_tokens`, a refusal (ValueError) of a conversation
        that certainly renders to more tokens, decided before it is tokenized."""
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template")
        template_kwargs = dict(template_kwargs or {})
        if clash := sorted(self._reserved & template_kwargs.keys()):
            raise ValueError(f"chat template arguments {clash} are not allowed")
        self._check_template_input(messages, tools, template_kwargs)
        args = {
            "conversation": [dict(m) for m in messages],
            "tools": [dict(t) for t in tools] if tools else None,
            "add_generation_prompt": add_generation_prompt,
            **template_kwargs,
        }
        if max_tokens is not None and self.max_token_chars is not None:
            bound = max_tokens * self.max_token_chars
            if _text_size([messages, tools, template_kwargs]) * _TEMPLATE_GROWTH > bound:
                self.check_fits(self._render(tokenize=False, **args), max_tokens)
        return list(self._render(tokenize=True, return_dict=False, sanitize_control_tokens=True, **args))

    def _check_template_input(self, messages: Any, tools: Any, template_kwargs: Mapping[str, Any]) -> None:
        """Raise ValueError for what the template would render unescaped: transformers encodes the
        control tokens in strings as text, but not in mapping keys (a tool call's argument names, a
        schema's property names), nor once the template has turned a container into its repr (the
        markers that make them text are then escaped away). So keys must hold no control token and
        template arguments must be plain values."""
        for name, value in template_kwargs.items():
            if not (value is None or isinstance(value, (str, int, float, bool))):
                raise ValueError(
                    f"chat_template_kwargs.{name} must be a string, number, boolean or null, "
                    f"not {type(value).__name__}"
                )
        if self._control is None:
            return
        stack: list[Any] = [messages, tools, template_kwargs]
        while stack:  # a stack of its own: the depth of client data is no concern here
            v = stack.pop()
            if isinstance(v, Mapping):
                for k, x in v.items():
                    if isinstance(k, str) and (hit := self._control.search(k)):
                        raise ValueError(f"the key {k[:64]!r} holds the control token {hit.group()!r}")
                    stack.append(x)
            elif isinstance(v, (list, tuple)):
                stack.extend(v)

    def _render(self, **args: Any):
        import jinja2  # a dependency of transformers' chat templates

        try:
            with self._lock:
                return self.hf.apply_chat_template(**args)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {_one_line(e)}") from e
        except ValueError:
            raise
        except Exception as e:  # the template is checkpoint code: 1/0 or "a" + 1 raise plain Python errors
            raise ValueError(f"chat template: {_one_line(e)}") from e


def _text_size(value: Any) -> int:
    """Characters in the strings of a JSON-like value (its keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(len(str(k)) + _text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


def _decoder_copy(backend: Any) -> Any:
    """An independent copy of the fast tokenizer for decoding, or None for a slow tokenizer."""
    if backend is None:
        return None
    from tokenizers import Tokenizer as FastTokenizer

    return FastTokenizer.from_str(backend.to_str())


def _max_token_chars(hf: Any, backend: Any) -> int | None:
    """The longest token string, when the pre-tokenizer keeps every character (else no bound)."""
    if backend is None:
        return None
    pre = json.loads(backend.to_str()).get("pre_tokenizer")
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    for step in steps:
        if step is None:
            continue
        kind = step.get("type")
        if kind == "Split" and step.get("behavior") != "Removed":
            continue
        if kind not in _KEEPING_PRETOKENIZERS:
            return None
    return max(len(t) for t in hf.get_vocab())
