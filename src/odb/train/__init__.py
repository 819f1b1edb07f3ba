"""Training helpers: exact loss scaling (``loss``), OOM fallback (``oom``, ``batch_split``) and
batched generation under a token budget (``generation``)."""
