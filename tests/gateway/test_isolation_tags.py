"""Tenants' prompts hashed apart by a secret tag (`prefix_isolation: tenant`): a tenant who knows another's
name and the routing hash (it is in the source) cannot compute a prompt whose prefix hashes equal that
tenant's, as it could when the tag was the tenant's name."""

from __future__ import annotations

import random
import struct
from pathlib import Path

from corral.gateway.context import RequestContext
from corral.gateway.isolation import TenantIsolation
from corral.protocol import CompletionRequest
from corral.routing import PrefixAffinity, Replica, ReplicaState, RouteRequest
from corral.routing.request import _MIX_C_INT, _POSITION_MIX_INTS, _WORD_MIX_INTS, prefix_hashes

MASK = 2**64 - 1
DOCUMENT = "Bob's board memo: we will acquire the company named in annex B at forty dollars a share. " * 16


def _block(data: bytes) -> int:
    """Routing's hash of one 128-byte block (routing/request.py), as anyone can compute it."""
    x = sum(w * m for w, m in zip(struct.unpack("<16Q", data), _WORD_MIX_INTS, strict=True)) & MASK
    x ^= x >> 31
    x = x * _MIX_C_INT & MASK
    return x ^ (x >> 29)


def _unmix(y: int) -> int:
    """The word sum a block needs for its hash to be `y` (the mixing steps undone)."""
    x = y
    for _ in range(3):
        x = y ^ (x >> 29)
    y = x * pow(_MIX_C_INT, -1, 2**64) & MASK
    x = y
    for _ in range(3):
        x = y ^ (x >> 31)
    return x


def _forge(victim: bytes, mine: bytes) -> str:
    """Text that, after the routing prompt's start `mine`, makes a prompt whose prefix hashes from its
    second block on equal those of the routing prompt `victim` (whose start is as long as `mine`): its
    second block's words are random letters but one, solved for, until that one is ASCII too."""
    p0, p1 = _POSITION_MIX_INTS[0], _POSITION_MIX_INTS[1]
    first = mine + b"x" * (128 - len(mine))
    wanted = (_block(victim[:128]) * p0 + _block(victim[128:256]) * p1 - _block(first) * p0) & MASK
    words_sum = _unmix(wanted * pow(p1, -1, 2**64) & MASK)
    inverse = pow(_WORD_MIX_INTS[0], -1, 2**64)
    rng = random.Random(7)
    for _ in range(1_000_000):
        letters = bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=120))
        known = sum(w * m for w, m in zip(struct.unpack("<15Q", letters), _WORD_MIX_INTS[1:], strict=True))
        word = ((words_sum - known) * inverse & MASK).to_bytes(8, "little")
        if all(0x20 <= b < 0x7F for b in word):  # about 1 in 2,800
            return (first[len(mine) :] + word + letters + victim[256:]).decode()
    raise AssertionError("no printable word found")


def _routed(isolation: TenantIsolation, tenant: str, prompt: str) -> tuple[int, ...]:
    """The prefix hashes routing reads of a prompt of `tenant`'s (the model's prompts kept apart)."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    ctx = RequestContext("/v1/x", body, b"{}", 0.0, RouteRequest("m", prompt=prompt))
    isolation.apply(ctx, tenant)
    return ctx.route.hash_prompt(PrefixAffinity().hasher)


def test_a_tenant_who_knows_another_s_name_cannot_forge_a_prompt_that_finds_its_blocks() -> None:
    isolation = TenantIsolation.of({"m"}, "the admin key", open_access=False)
    bobs, policy = Replica(id="r0", model="m", engine="sim", state=ReplicaState.READY), PrefixAffinity()
    victim = "user:" + DOCUMENT  # what routing reads of bob's chat
    policy.index.record(_routed(isolation, "bob", victim), bobs)
    # eve knows the hash and bob's name, and guesses his document: with names for tags, her forged
    # prompt's hashes are his from its second block on (so routing finds his whole document on his replica)
    forged = _forge(b"3:bob\n" + victim.encode(), b"3:eve\n")
    assert prefix_hashes("3:eve\n" + forged)[1:] == prefix_hashes("3:bob\n" + victim)[1:]
    hashes = _routed(isolation, "eve", forged)
    assert policy.index.depths(hashes, [bobs]) == {"r0": 0}
    # while bob's own next request still finds his whole document there
    blocks = len(_routed(isolation, "bob", victim))
    assert policy.index.depths(_routed(isolation, "bob", victim + " And annex C?"), [bobs]) == {"r0": blocks}


def test_without_an_admin_key_the_tags_come_from_the_store_s_own_secret(tmp_path: Path) -> None:
    """A gateway without an admin key derived its tenants' tags from an empty secret anyone could
    compute: it takes a random one its store keeps, the same for every gateway and worker on that store."""
    from corral.config import AuthSettings
    from corral.routing import ReplicaSet

    from .conftest import make_services

    one = make_services(ReplicaSet(["m"]), tmp_path / "a.db", auth=AuthSettings(open=False))
    same = make_services(ReplicaSet(["m"]), tmp_path / "a.db", auth=AuthSettings(open=False))
    other = make_services(ReplicaSet(["m"]), tmp_path / "b.db", auth=AuthSettings(open=False))
    assert len(one.isolation_secret) == 64 and one.isolation_secret == same.isolation_secret
    assert other.isolation_secret != one.isolation_secret
    keyed = make_services(ReplicaSet(["m"]), tmp_path / "a.db", auth=AuthSettings(open=False), admin_key="k")
    assert keyed.isolation_secret == "k"  # (as before: the tags of a gateway with an admin key stay)
