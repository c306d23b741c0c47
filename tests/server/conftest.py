"""The live servers the server tests share: the app as `m3lm serve` serves it, over real HTTP."""

import openai
import pytest

from tests.support.checkpoints import write_chat_checkpoint
from tests.support.live_server import API_KEY, start
from tests.support.paths import PATIENCE_S
from tests.support.story_server import story_server


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    """A tiny random checkpoint with M3's tokenizer and chat template (read only)."""
    return write_chat_checkpoint(tmp_path_factory.mktemp("served"), seed=3)


@pytest.fixture(scope="module")
def live(served_checkpoint):
    """A server on `served_checkpoint` with the default limits, one per test module; a module that
    needs other settings defines its own `live`."""
    server = start(served_checkpoint)
    yield server
    server.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=PATIENCE_S)


@pytest.fixture(scope="module")
def story_live(request):
    """The embedded story model served in this process (fp32), one per test module, with the
    context a module asks for in `STORY_CONTEXT` (default 256)."""
    with story_server(max_model_len=getattr(request.module, "STORY_CONTEXT", 256)) as server:
        yield server
