"""FairShare (worker/fair_share.py): deficit round robin over tenants, in tokens, no Redis."""

from __future__ import annotations

import pytest

from llmq.worker.fair_share import FairShare, parse_weights


def serve(shares: FairShare, costs: dict[str, int], rounds: int) -> dict[str, int]:
    """Tokens each always-backlogged tenant gets over `rounds` reads of one entry each."""
    got = dict.fromkeys(costs, 0)
    for _ in range(rounds):
        for tenant in shares.eligible(list(costs)):
            shares.charge(tenant, costs[tenant])
            got[tenant] += costs[tenant]
    return got


def test_equal_weights_give_equal_tokens_whatever_the_request_sizes() -> None:
    # Given acme sends requests 8 times bob's size
    got = serve(FairShare(quantum=512), {"acme": 800, "bob": 100}, rounds=2000)
    # Then each gets about half of the tokens, not half of the requests
    assert abs(got["acme"] / sum(got.values()) - 0.5) < 0.02, got


def test_weights_split_tokens_in_proportion() -> None:
    got = serve(FairShare({"acme": 2.0}, quantum=256), {"acme": 100, "bob": 100}, rounds=3000)
    assert abs(got["acme"] / sum(got.values()) - 2 / 3) < 0.02, got


def test_an_idle_tenant_banks_no_credit() -> None:
    # Given bob's stream ran empty while credited
    shares = FairShare(quantum=1000)
    shares.eligible(["acme", "bob"])
    shares.emptied("bob")
    # Then it comes back with nothing in hand, and a debt is kept
    assert shares.deficits["bob"] == 0
    shares.charge("acme", 5000)
    shares.emptied("acme")
    assert shares.deficits["acme"] < 0


@pytest.mark.parametrize("text", ["acme", "acme=0", "acme=-1", "acme=x", "=2", "acme=inf"])
def test_bad_weights_name_the_item(text: str) -> None:
    with pytest.raises(ValueError, match="tenant weight"):
        parse_weights(text)


def test_weights_parse() -> None:
    assert parse_weights(" acme=2, bob=0.5 ,") == {"acme": 2.0, "bob": 0.5}
