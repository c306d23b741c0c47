"""Speculative decoding's settings, as vLLM's `--speculative-config` spells them."""

from __future__ import annotations

from dataclasses import dataclass

from m3lm.errors import ConfigError
from m3lm.json_settings import json_settings

SPEC_METHODS = ("ngram", "eagle3")
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` spells it.

    `method`: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of
    the sequence's last `prompt_lookup_max` down to `prompt_lookup_min` tokens, 5 and 5 unless
    set) or "eagle3" (an EAGLE-3 drafter checkpoint at `model`). Up to `num_speculative_tokens`
    drafts per running sequence are verified in each step.
    """

    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative_config: method = {self.method!r} is not supported (expected one of "
                f"{', '.join(SPEC_METHODS)})"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"speculative_config: {key} = {v!r} must be an integer >= 1")
        if self.num_speculative_tokens > 64:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens = {self.num_speculative_tokens} must be <= 64"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = lo or hi or 5, hi or lo or 5  # one given stands for both, as in vLLM
            if lo > hi:
                raise ConfigError(
                    f"speculative_config: prompt_lookup_min = {lo} is above prompt_lookup_max = {hi}"
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ConfigError('speculative_config: method "ngram" takes no model')
        elif not self.model:
            raise ConfigError('speculative_config: method "eagle3" needs "model" (the drafter\'s directory)')

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict or its JSON text (the command line's form); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_settings(value, "speculative_config", SPEC_KEYS)
        if "method" not in value:
            raise ConfigError(f'speculative_config needs "method" ({" or ".join(SPEC_METHODS)})')
        return cls(**value)
