"""Optimizer steps: which samples form each (``composition``), the cut of one rank's share into micro-batches at
the least cost (``step_cut``), one step of every rank's samples planned across ranks (``global_plan``) and its
micro-batches dealt by predicted seconds (``price_deal``)."""
