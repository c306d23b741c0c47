"""Files shipped inside the package."""

from pathlib import Path

# The embedded default model: a 10M-parameter MiniMax-M3 (MSA + MoE) trained on short stories.
DEFAULT_MODEL = Path(__file__).parent / "story"
# Its EAGLE-3 drafter (`--speculative-config '{"method": "eagle3", "model": DIR}'`), trained on the CPU.
DEFAULT_DRAFTER = Path(__file__).parent / "story-eagle3"
