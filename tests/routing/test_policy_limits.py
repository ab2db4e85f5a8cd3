"""Routing policies at their limits: fleets past the prefix index's floor, one tenant's prompts against the
learnt tokens per block, one busy session against its replica."""

from __future__ import annotations

import base64

import pytest

from corral.engines import EngineLoad, parse_vllm_load
from corral.gateway.intake import prompt_text
from corral.protocol import ChatCompletionRequest
from corral.routing import (
    PrefixAffinity,
    ReplicaSet,
    Router,
    RouteRequest,
    SessionAffinity,
)

from .test_policies import fleet


def test_a_fleet_of_more_than_64_replicas_keeps_every_replica_s_prefixes() -> None:
    replicas = ReplicaSet(["m"])
    for replica in fleet(100):
        replicas.add(replica)
    router = Router(replicas)  # the default policy: prefix_affinity
    documents = [f"tenant {i}'s own long document, line after line. " * 30 for i in range(100)]
    first = {}
    for document in documents:  # idle and equal: each document goes to the next replica in turn
        request = RouteRequest("m", prompt=document + "first question", prompt_tokens=400)
        first[document] = router.acquire(request)
        router.release(first[document], request, ok=True)
    assert len(set(first.values())) == 100
    for document in reversed(documents):  # every document's next request finds it where it went
        request = RouteRequest("m", prompt=document + "second question", prompt_tokens=400)
        assert router.acquire(request) is first[document]
        router.release(first[document], request, ok=True)
    for replica in replicas.of("m")[:90]:  # a fleet that shrinks: the index keeps only who is left
        replicas.remove(replica)
    router.release(router.acquire(request), request, ok=True)
    policy = router.policy_for("m")
    assert isinstance(policy, PrefixAffinity)
    assert len(policy.index.held()) == 10


def _chat_with_image(question: str, image_bytes: int) -> str:
    """The routing prompt of a chat with an image (as the gateway writes it: the content parts' text)."""
    image = base64.b64encode(bytes(range(256)) * (image_bytes // 256)).decode()
    content = [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return prompt_text(ChatCompletionRequest.model_validate(body))


def test_an_image_s_base64_does_not_teach_the_tokens_per_block() -> None:
    policy = PrefixAffinity()
    text = "an ordinary question about this quarter's sales, in a few words\n" * 32  # 2 KB: 16 blocks
    assert len(text) == 2048
    policy.observe(RouteRequest("m", prompt=text), 512)  # 32 tokens a block
    assert policy.block_tokens == pytest.approx(32)
    # a 3 KB image (4 KB of base64, 33 blocks) the engine reads as 600 tokens: 18 a block, within what text
    # gives, but no text's: the replicas' caches would be over-stated by 1.8×
    prompt = _chat_with_image("what is in this picture?", 3072)
    assert 30 < len(prompt) / 128 < 40
    for _ in range(50):
        policy.observe(RouteRequest("m", prompt=prompt), 600)
    assert policy.block_tokens == pytest.approx(32)


def test_one_tenant_s_prompts_move_the_tokens_per_block_by_its_share_at_most() -> None:
    policy = PrefixAffinity()
    text = "an ordinary question about this quarter's sales, in a few words\n" * 32  # 2 KB: 16 blocks
    for tenant in ("acme", "globex", "initech", "umbrella"):
        for _ in range(5):
            policy.observe(RouteRequest("m", tenant=tenant, prompt=text), 512)  # 32 a block
    dense = "🙂🙃😉😊" * 128  # 2 KB of emoji, about 2 tokens each: 60 a block
    for _ in range(1000):
        policy.observe(RouteRequest("m", tenant="eve", prompt=dense), 960)
    # eve's own estimate is 60, the others' 32: the policy's is their mean, not eve's
    assert policy.block_tokens == pytest.approx((4 * 32 + 60) / 5)
    # and one tenant alone still teaches its engine's tokens per block
    alone = PrefixAffinity()
    for _ in range(100):
        alone.observe(RouteRequest("m", tenant="eve", prompt=dense), 960)
    assert alone.block_tokens == pytest.approx(60)


def test_one_busy_session_spills_from_its_replica_past_the_load_bound() -> None:
    replicas, policy = fleet(4), SessionAffinity()
    home = policy.pick(replicas, RouteRequest("m", session="one-user-for-everything")).replica
    home.outstanding = 20  # the mean is 5: a bound of 1.5 × 5 + 16 = 23.5, not yet past
    assert policy.pick(replicas, RouteRequest("m", session="one-user-for-everything")).replica is home
    home.outstanding = 40  # the mean is 10: a bound of 31, past it
    spilled = policy.pick(replicas, RouteRequest("m", session="one-user-for-everything")).replica
    assert spilled is not home
    # the session's next replica by rendezvous (where it would go if its home left), not any idle one
    others = [r for r in replicas if r is not home]
    assert policy.pick(others, RouteRequest("m", session="one-user-for-everything")).replica is spilled
    home.outstanding = 0  # its home is back within the bound: the session returns
    assert policy.pick(replicas, RouteRequest("m", session="one-user-for-everything")).replica is home


def test_an_engine_that_reports_a_negative_queue_draws_no_more_than_its_share() -> None:
    """An engine's `vllm:num_requests_waiting -1000000` made its replica's load negative, always within the
    load bound and the cheapest: every request went to it (an `external` engine drawing every tenant's
    prompts). Its queue is read as empty: it takes its turn as an idle replica does."""
    replicas = ReplicaSet(["m"])
    for replica in fleet(4):
        replica.capacity = 8
        replica.load = EngineLoad(running=0, waiting=0)
        replicas.add(replica)
    liar = replicas.of("m")[0]
    liar.load = parse_vllm_load("vllm:num_requests_waiting -1000000\nvllm:num_requests_running -3\n")
    router = Router(replicas)
    taken = {r.id: 0 for r in replicas}
    for i in range(200):  # all in flight at once (none released)
        request = RouteRequest(model="m", tokens=300, prompt=f"tenant doc {i} " * 40, prompt_tokens=200)
        taken[router.acquire(request).id] += 1
    assert max(taken.values()) <= 60, taken
    assert (liar.load.waiting, liar.load.running) == (0, 0)
