"""Read your own writes in the vLLM scheduler (kvtier/integrations/vllm/own_saves.py): how long a
save this engine planned is promised to its next lookups."""

from __future__ import annotations

from kvtier.integrations.vllm.own_saves import OwnSaves

K = [bytes([i]) * 32 for i in range(4)]


def test_a_promise_outlasts_a_step_longer_than_land_s() -> None:
    now = [0.0]
    own = OwnSaves(land_s=0.5, clock=lambda: now[0])
    own.step()
    own.note(K[:2])  # planned in this step; the forward pass then takes 5 s
    now[0] += 5.0
    assert own.landing([K[:3]], [[False, False, False]]) == [[True, True, False]]
    own.step()  # the step after: the save may still be running under async scheduling
    now[0] += 5.0
    assert own.landing([K[:2]], [[False, False]]) == [[True, True]]
    own.step()  # two steps on: the countdown starts now
    now[0] += 0.4
    assert own.landing([K[:2]], [[False, False]]) == [[True, True]]
    now[0] += 0.2
    assert own.landing([K[:2]], [[False, False]]) == [[False, False]]  # dropped saves are not promised for ever
    now[0] += 1.0
    own.step()  # expired promises are pruned (at most once a second)
    assert not own


def test_a_placed_block_is_forgotten_and_a_new_save_restarts_its_promise() -> None:
    now = [0.0]
    own = OwnSaves(land_s=0.5, clock=lambda: now[0])
    own.step()
    own.note(K[:2])
    assert own.landing([K[:2]], [[True, False]]) == [[True, True]]
    assert K[0] not in own.pending and K[1] in own.pending
    for _ in range(2):
        own.step()
    own.note([K[1]])  # saved again (another request): pending again, no countdown
    now[0] += 10.0
    assert own.landing([K[1:2]], [[False]]) == [[True]]
