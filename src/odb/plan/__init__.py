"""Planning: pure numpy decisions over sample lengths, no torch.

The cost of a group of samples (``cost``), the padded and packed planners of one window
(``planner``, ``packing``, their shared answer ``pool_plan``), the window sizes and the stream
of windows with its carry (``window``), the steps every rank agrees on (``align``) and how
each rank fits its groups to them (``fitting``), the steps of an epoch estimated
from a sample of lengths (``estimate``), shape buckets (``buckets``) and budget schedules
(``schedule``); for ``token_budget="auto"``, a batch's features (``step_features``), the step
model fitted on them (``step_model``), the planner settings it gives (``budget_plan``) and how
it proposes them (``auto_budget``). Nothing here imports torch: it can be tested, benchmarked and reasoned
about on integer arrays alone.
"""
