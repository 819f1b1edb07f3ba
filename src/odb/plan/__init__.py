"""Planning: pure numpy decisions over sample lengths, no torch, grouped by what each part decides.

* ``costs``: what a batch costs (the cost model, a window's prices, shape buckets, budget schedules);
* ``windows``: how a window of samples is grouped into batches (the padded and packed planners, the carry,
  step estimates);
* ``steps``: optimizer steps (which samples form each, the cut of a step into micro-batches, a step planned
  across ranks, the deal by predicted seconds);
* ``ranks``: how ranks run together (the agreed step counts, fitting a rank's groups, pairing them);
* ``rollouts``: an RL trainer's rollout rows cut into micro-steps, per rank or across ranks;
* ``auto``: ``token_budget="auto"``'s fitted step model and the plans it proposes.

Nothing here imports torch: it can be tested, benchmarked and reasoned about on integer arrays alone.
"""
