"""The layouts odb runs an RL trainer's micro-batch in (odb.integrations.trl.rl_forward.layout_rows): every token
TRL scores is predicted from the same preceding tokens of its own rollout, and nothing else is scored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.integrations.trl.rl_forward import RolloutForward, layout_rows


def rollouts(seed: int, rows: int, width_p: int, width_c: int):
    """TRL's rows: prompts left-padded (at least one token), completions right-padded (maybe empty)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(1, width_p + 1, (rows,), generator=gen)
    c = torch.randint(0, width_c + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(width_p)[None] >= width_p - p[:, None]).long()
    completion_mask = (torch.arange(width_c)[None] < c[:, None]).long()
    ids = torch.randint(3, 50, (rows, width_p + width_c), generator=gen)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    return ids * mask, mask


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 5), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from(["padded", "packed"]), st.sampled_from([1, 4]))
def test_every_scored_token_follows_its_own_rollout(seed, rows, width_p, width_c, layout, multiple):
    ids, mask = rollouts(seed, rows, width_p, width_c)
    lay = layout_rows(ids, mask, width_c, layout, multiple)
    flat_ids, flat_labels = lay.input_ids.reshape(-1), lay.shift_labels.reshape(-1)
    # Scored exactly where TRL scores: the completion tokens its mask keeps, and no label anywhere else.
    assert torch.equal(lay.scored, mask[:, width_p:].bool())
    assert int((flat_labels != -100).sum()) == int(lay.scored.sum())
    for i in range(rows):
        real = ids[i][mask[i].bool()].tolist()
        for c in range(width_c):
            if not lay.scored[i, c]:
                continue
            at = int(lay.source[i, c])
            assert int(flat_labels[at]) == int(ids[i, width_p + c])  # the label read back is TRL's token...
            # ...and the tokens up to that place are the rollout's own, from its first
            k = int(mask[i, :width_p + c].sum())  # real tokens before it
            start = at - (k - 1)
            assert flat_ids[start:at + 1].tolist() == real[:k]
            if layout == "packed":
                assert lay.position_ids.reshape(-1)[start:at + 1].tolist() == list(range(k))
    if layout == "padded":
        span = lay.input_ids.shape[1]
        assert span % multiple == 0 and span - multiple < int(mask.sum(1).max()) <= span
        assert torch.equal(lay.attention_mask.sum(1), mask.sum(1))
    else:
        assert lay.input_ids.shape == (1, int(mask.sum())) and lay.attention_mask is None


def test_rows_with_holes_or_without_a_prompt_are_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        layout_rows(torch.ones(1, 5, dtype=torch.long), torch.tensor([[1, 0, 1, 1, 0]]), 3, "padded")
    with pytest.raises(ValueError, match="no prompt token before it"):
        layout_rows(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 0, 1, 1]]), 2, "packed")
    with pytest.raises(ValueError, match="layout='rows' for an RL trainer"):
        RolloutForward("rows")
