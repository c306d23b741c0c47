"""Schemathesis over the server's own OpenAPI schema: no 5xx, responses as documented.

The suite draws the same 20 examples an operation every run (conftest's hypothesis profile), so
that its result does not depend on the draw. A longer random search:
HYPOTHESIS_PROFILE=explore M3LM_FUZZ_EXAMPLES=3000 pytest tests/server/test_schema_fuzz.py
"""

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import positive_data_acceptance  # noqa: E402

import m3lm  # noqa: E402
from m3lm.config import EngineConfig  # noqa: E402
from m3lm.engine.engine import LLMEngine  # noqa: E402
from m3lm.server.app import create_server_app  # noqa: E402
from m3lm.server.engine_client import AsyncEngine  # noqa: E402
from m3lm.server.protocol import Limits  # noqa: E402
from tests.support.checkpoints import write_chat_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    path = write_chat_checkpoint(tmp_path_factory.mktemp("fuzz"), seed=1)
    model, tok = m3lm.load(path, device="cpu")
    engine = AsyncEngine(LLMEngine(model, tok, EngineConfig(max_model_len=128, max_num_seqs=4)), 16).start()
    app = create_server_app(engine, tok, "tiny", None, Limits(max_n=2))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    )
    yield schema
    engine.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


EXAMPLES = int(os.environ.get("M3LM_FUZZ_EXAMPLES", "0"))


@schema.parametrize()
@settings(
    max_examples=EXAMPLES or 20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_never_fails_with_5xx(case):
    if isinstance(case.body, dict):  # keep generation short; other values stay as generated
        required = case.path == "/v1/messages"  # max_tokens is required there: its absence is a case
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(key)
            if (value is None and not required) or (
                isinstance(value, int) and not isinstance(value, bool) and value > 4
            ):
                case.body[key] = 4
    # The API has rules a JSON schema cannot state (a prompt within the context, tool_choice naming
    # a listed tool, caps on n x prompts): a schema-valid request may still get a 400.
    case.call_and_validate(excluded_checks=[positive_data_acceptance])
