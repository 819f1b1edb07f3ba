"""What a batch costs: the cost model of a group of samples (``cost``) under a window's prices (``plan_costs``),
shape buckets (``buckets``) and budget schedules (``schedule``)."""
