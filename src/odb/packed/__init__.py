"""The packed (padding-free) layout: the collate of one row per batch (``collate``), the model
checks that make it exact (``models``) and a per-sample attention, ``odb_varlen``
(``attention``)."""
