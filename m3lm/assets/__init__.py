"""Files shipped inside the package."""

from pathlib import Path

# The embedded default model: a 10M-parameter MiniMax-M3 (MSA + MoE) trained on short stories.
DEFAULT_MODEL = Path(__file__).parent / "story"
