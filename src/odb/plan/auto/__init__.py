"""``token_budget="auto"``: a batch's features (``step_features``), the step model fitted on them (``step_model``,
its solver ``nnls``), the planner settings it gives (``budget_plan``) and how it proposes them (``auto_budget``)."""
