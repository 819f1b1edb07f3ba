"""How a window of samples is grouped into batches: the padded and packed planners (``planner``, ``packing``, their
shared answer ``pool_plan``), window sizes and the stream of windows with its carry (``window``), and the steps of
an epoch estimated from a sample of lengths (``estimate``)."""
