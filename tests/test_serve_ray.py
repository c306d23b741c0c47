"""Ray Serve (`m3lm/serve_ray.py`) for real: a local Ray with two CPUs runs two replicas of the
embedded model behind one OpenAI endpoint, driven over HTTP by the official openai client. Which
replica answered is the `x-m3lm-replica` header. Skipped where Ray is not installed (`m3lm[ray]`)."""

import threading
import time
import uuid

import openai
import pytest

from m3lm.engine.launch import free_port
from tests.support.paths import PATIENCE_S

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'm3lm[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'm3lm[ray]')")
from m3lm.serve_ray import REPLICA_HEADER, build  # noqa: E402  (after the skip)

pytestmark = pytest.mark.slow

APP = "m3"
SERVE_ARGS = "--device cpu --threads 1 --compile off --max-num-seqs 4 --served-model-name story"
# a shared prefix of three 128-token pages and more, so its requests find cached pages
PREFIX = " ".join(["Lily and her dog Max walked to the park to play with a big red ball."] * 30)


@pytest.fixture(scope="module")
def client():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20)  # the least Ray allows
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"serve_args": SERVE_ARGS, "num_replicas": 2}), name=APP, route_prefix="/")
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=PATIENCE_S
        )
    finally:
        serve.shutdown()
        ray.shutdown()


def replicas() -> set[str]:
    """The replica actors alive now (their names are what the header carries)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in named if a["name"].startswith(f"SERVE_REPLICA::{APP}#Replica#")}


def stream_chat(client, content: str, **kw):
    return client.chat.completions.with_streaming_response.create(
        model="story", messages=[{"role": "user", "content": content}], stream=True, **kw
    )


def complete(client, prompt: str, max_tokens: int = 2, **kw):
    raw = client.completions.with_raw_response.create(
        model="story", prompt=prompt, max_tokens=max_tokens, **kw
    )
    return raw.headers[REPLICA_HEADER], raw.parse()


def test_the_openai_client_streams_and_requests_spread_over_both_replicas(client):
    served = []
    for content in ("Anna found a shell", "Bob had a kite", "Cats like to nap", "Dad baked bread"):
        with stream_chat(client, content, max_tokens=4) as resp:
            chunks = list(resp.parse())
            served.append(resp.headers[REPLICA_HEADER])
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # prompts that share no prefix go to the replica that has been sent the least text
    assert set(served) == replicas() and len(set(served)) == 2


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(client):
    first, _ = complete(client, PREFIX + " One day")
    for end in (" The sun", " Later that day", " At night"):
        replica, reply = complete(client, PREFIX + end)
        assert replica == first
        assert reply.usage.prompt_tokens_details.cached_tokens >= 3 * 128  # the pages it holds


def test_a_killed_replica_is_replaced_and_its_requests_fail_clearly(client):
    holder, _ = complete(client, PREFIX + " Once")  # the prefix's replica, which the kill takes
    before = replicas()
    whole: dict = {}  # a request answered whole, in flight at the kill too

    def whole_request():
        try:
            whole["reply"] = complete(client, PREFIX + " Twice", 1024, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            whole["error"] = e

    waiting = threading.Thread(target=whole_request)
    waiting.start()
    with stream_chat(client, PREFIX, max_tokens=1024, extra_body={"ignore_eos": True}) as resp:
        assert resp.headers[REPLICA_HEADER] == holder
        chunks = resp.parse()
        for _ in range(4):
            next(chunks)
        whole_in_flight = waiting.is_alive()
        ray.kill(ray.get_actor(holder, namespace="serve"))
        with pytest.raises(openai.APIError, match="replica serving this stream was lost"):
            for _ in chunks:
                pass
    waiting.join(PATIENCE_S)
    assert not waiting.is_alive()
    if whole_in_flight:  # else it finished before the kill (a machine far faster than this one)
        assert whole["error"].status_code == 503 and "was lost" in whole["error"].message

    # Ray Serve starts a replica in its place; a prompt new to both then goes to the new one, the
    # one sent the least text
    deadline = time.monotonic() + PATIENCE_S
    while len(new := replicas() - before) != 1:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.2)
    (new,) = new
    while True:
        try:
            served, reply = complete(client, f"{uuid.uuid4().hex}: the owl sang")
        except openai.APIStatusError as e:  # 503 until the new replica has loaded
            assert e.status_code == 503, e
            served = None
        if served == new:
            break
        assert time.monotonic() < deadline, "no request reached the new replica"
        time.sleep(0.2)
    assert reply.choices[0].text
